"""Freeing finished instances' stores off the critical path.

Freeing a store hands its slot back to the pooling allocator, which resets the slot's memory
(a memset of up to `keep_resident_bytes`, host/wasm/pooling.py): ~0.6 ms of CPU for a slot that
has been used before, ~25 ms the first time (the reset faults the slot's pages in, each
copy-on-write fault a TLB-flush interrupt to the other cores). When a burst of instances
finishes together, each freeing its own store on its own thread, those resets compete for the
cores with the instances still finishing, and the burst's last answers come late. The reaper
frees stores on one thread of its own, while the backend is idle, and under load each within
`max_delay_s`.

Under sustained load the backend is never idle, and one thread may not keep up: a store waiting
keeps its slot, so the next launch takes a slot never used before (the allocator reuses a freed
slot of the same module first), whose start and free cost ~20x more, which puts the reaper
further behind. Measured with 256 instances kept running (bench/host_sustained.py), a host
that only queued reached 1,500 waiting stores in 12 s and then refused launches because its
instance pool was full. So when the reaper is behind (its oldest store has waited `max_delay_s`,
or `max_pending` wait) the instance that ends frees its own store, on its own thread, at once:
frees then keep pace with ends, slots are reused while their pages are resident, and the
reaper's thread only defers what a burst leaves.

In the background (`background=True`, where host/wasm/priority.py can lower a thread): the reaper's
thread runs at the lowest CPU priority and frees each store at once, busy backend or not, except
while launched instances are starting (`ramping`, host/wasm/starts.py's `Starts`; a pause lasts
at most `START_MAX_WAIT_S`, and `max_pending` stores are freed at once still): it takes only the
CPU the instances leave, and a host that serves bursts back to back, never idle, still has its
slots reset before the next burst takes them. Measured before that pause (bench/host_scale.py
--back-to-back, 256 at 10 ms): the last burst's 256 frees, ~220 ms of CPU, overlapped the next
burst's start because each store waited at most `max_delay_s`.

Invariants: an instance's store is handed over after its terminal event and after everything the
instance held in the host (pages, forwards, subscriptions) was released; nothing uses a store after
it is handed over; `close` frees everything still queued.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from host.wasm import priority
from host.wasm.starts import START_MAX_WAIT_S, START_POLL_S

__all__ = ["StoreReaper"]

log = logging.getLogger(__name__)


class StoreReaper:
    """Frees stores (objects with `close()`) on a thread of its own, preferably while `busy()` is False."""

    def __init__(self, busy: Callable[[], bool], max_pending: int = 256, max_delay_s: float = 0.25,
                 poll_s: float = 0.02, background: bool = False, ramping: Callable[[], bool] | None = None,
                 threads: int = 1, on_free: Callable[[], None] | None = None) -> None:
        self._busy = busy
        self._on_free = on_free or (lambda: None)  # called after each store is freed
        self._ramping = ramping or (lambda: False)
        self._ramp_since: float | None = None  # since when frees wait for starting instances
        self.background = background
        self.max_pending = max_pending
        self.max_delay_s = max_delay_s
        self.poll_s = poll_s
        self._queue: deque[tuple[float, Any]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.free_when_behind = True  # False: queue every store, however far behind (the rule before)
        self.freed_inline = 0  # stores put while the reaper was behind, freed by their caller
        self._freeing = 0  # stores taken off the queue by the threads, not freed yet (guarded by _cond)
        # several threads free in parallel on a host with the cores (a reset runs without the GIL)
        self._threads = [threading.Thread(target=self._run, name="pie-reaper" if i == 0 else f"pie-reaper-{i}",
                                          daemon=True) for i in range(max(threads, 1))]
        for t in self._threads:
            t.start()

    def put(self, store: Any) -> None:
        """Free `store` soon; at once, on the calling thread, if the reaper is closed or behind."""
        now = time.monotonic()
        with self._cond:
            if not self._closed and not (self.free_when_behind and self._behind(now)):
                self._queue.append((now, store))
                if len(self._queue) <= len(self._threads):
                    self._cond.notify()  # a thread waits for it; past that many, they look at later ones themselves
                return
            self.freed_inline += 1
        self._free(store)  # outside the lock: the reaper's thread and other ending threads go on

    def _behind(self, now: float) -> bool:
        """Whether the queue has fallen behind its limits (called with the lock held)."""
        return len(self._queue) >= self.max_pending or bool(self._queue) and now - self._queue[0][0] >= self.max_delay_s

    def pending(self) -> int:
        return len(self._queue)

    def wait_drained(self, timeout_s: float) -> bool:
        """Wait until every store queued so far is freed (or `timeout_s`); True if they are."""
        with self._cond:
            return self._cond.wait_for(lambda: self._closed or not self._queue and not self._freeing, timeout_s)

    def close(self) -> None:
        """Stop the thread and free every store still queued."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(5)
        while self._queue:
            self._free(self._queue.popleft()[1])

    def _wait_s(self) -> float:
        """0 if the oldest queued store is due to be freed now, else how long to wait before looking
        again: while the backend is busy, until that store has waited `max_delay_s`, looking at the
        backend every `poll_s`; in the background, while instances start, up to `START_MAX_WAIT_S`
        from the pause's start (called with the lock held)."""
        if len(self._queue) >= self.max_pending:
            return 0.0
        now = time.monotonic()
        if self.background:  # busy or not, but not while launched instances start (for a while at most)
            if not self._ramping():
                self._ramp_since = None
                return 0.0
            since = self._ramp_since = self._ramp_since or now
            return max(min(START_POLL_S, since + START_MAX_WAIT_S - now), 0.0)
        age = now - self._queue[0][0]
        if age >= self.max_delay_s or not self._busy():
            return 0.0
        return min(self.poll_s, self.max_delay_s - age)

    def _run(self) -> None:
        if self.background:
            priority.lower()
        while True:
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed:
                    return
                wait = self._wait_s()
                if wait > 0:
                    self._cond.wait(wait)
                    continue
                store = self._queue.popleft()[1]
                self._freeing += 1
            try:
                self._free(store)
            finally:
                with self._cond:
                    self._freeing -= 1
                    if not self._queue and not self._freeing:
                        self._cond.notify_all()  # (wait_drained)

    def _free(self, store: Any) -> None:
        try:
            store.close()
        except Exception:  # a store that cannot be freed is leaked, not fatal to the host
            log.exception("could not free an instance's store")
        self._on_free()
