"""Freeing finished instances' stores off the critical path.

Freeing a store hands its slot back to the pooling allocator, which resets the slot's memory
(a memset of up to `keep_resident_bytes`, host/wasm/pooling.py): measured ~2.7 ms of CPU per
`text_completion` instance, more than the rest of its end. When a burst of instances finishes
together, each freeing its own store on its own thread, those resets compete for the cores with
the instances still finishing, and the burst's last answers come late. The reaper frees stores on
one thread of its own, while the backend is idle; under load it still frees each store within
`max_delay_s`, and at once when `max_pending` stores are waiting (each holds a pool slot, which
the pool is sized for: host/host.py).

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

__all__ = ["StoreReaper"]

log = logging.getLogger(__name__)


class StoreReaper:
    """Frees stores (objects with `close()`) on a thread of its own, preferably while `busy()` is False."""

    def __init__(self, busy: Callable[[], bool], max_pending: int = 256, max_delay_s: float = 1.0,
                 poll_s: float = 0.005) -> None:
        self._busy = busy
        self.max_pending = max_pending
        self.max_delay_s = max_delay_s
        self.poll_s = poll_s
        self._queue: deque[tuple[float, Any]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="pie-reaper", daemon=True)
        self._thread.start()

    def put(self, store: Any) -> None:
        """Free `store` soon (at once if the reaper is closed)."""
        with self._cond:
            if not self._closed:
                self._queue.append((time.monotonic(), store))
                self._cond.notify()
                return
        _free(store)

    def pending(self) -> int:
        return len(self._queue)

    def close(self) -> None:
        """Stop the thread and free every store still queued."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        while self._queue:
            _free(self._queue.popleft()[1])

    def _due(self) -> bool:
        """Whether the oldest queued store should be freed now (called with the lock held)."""
        queued_at = self._queue[0][0]
        return (len(self._queue) > self.max_pending or time.monotonic() - queued_at >= self.max_delay_s
                or not self._busy())

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed:
                    return
                store = self._queue.popleft()[1] if self._due() else None
            if store is None:
                time.sleep(self.poll_s)
            else:
                _free(store)


def _free(store: Any) -> None:
    try:
        store.close()
    except Exception:  # a store that cannot be freed is leaked, not fatal to the host
        log.exception("could not free an instance's store")
