"""The batching scheduler: forwards from all instances merged into backend calls.

One scheduler thread owns the backend. Policies:
- adaptive (default): one batch in flight; when the backend returns, everything queued is
  fired at once, capped by `max_batch_tokens`. The instances of the batch that just returned
  need a moment (guest code, host calls) to submit their next step; firing at the first
  arrival would split them into many small batches, so the scheduler waits until each of
  them has resubmitted (or ended, or blocked on something else), at most a grace of half the
  last batch's time (<= 20 ms). Instances just launched are expected the same way (at most
  `launch_grace_s` after their launch), so requests that arrive together prefill together.
- k-or-t: fire when `k` forwards are queued or the oldest has waited `t_ms`.
Forwards of one instance keep their order: a forward is never batched together with, or
ahead of, an earlier queued forward whose pages it reads or writes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from gpu_backend.types import ForwardRequest, OutputResult

log = logging.getLogger(__name__)


_FUTURE_LOCK = threading.Lock()  # guards a future's done flag against its lazily made Event


class ForwardFuture:
    """Completion of one forward: `wait()` returns its outputs or raises the backend's error.

    The Event a blocking `wait()` needs is made only when someone blocks: instance threads
    wait on their own condition (woken by a done-callback), and finishing a batch is on the
    per-step critical path."""

    __slots__ = ("request", "owner", "submitted", "_done", "_event", "_result", "_error", "_callbacks")

    def __init__(self, request: ForwardRequest, owner: str) -> None:
        self.request = request
        self.owner = owner
        self.submitted = time.perf_counter()
        self._done = False
        self._event: threading.Event | None = None
        self._result: list[OutputResult] | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[ForwardFuture], None]] = []

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> list[OutputResult]:
        if not self._done:
            with _FUTURE_LOCK:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if not self._done and event is not None and not event.wait(timeout):
                raise TimeoutError("forward not finished")
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result

    def add_done_callback(self, fn: Callable[[ForwardFuture], None]) -> None:
        """Call `fn(self)` when done (at once if already done)."""
        self._callbacks.append(fn)
        if self._done:
            fn(self)

    def _finish(self, result: list[OutputResult] | None, error: BaseException | None) -> None:
        self._result, self._error = result, error
        with _FUTURE_LOCK:
            self._done = True
            event = self._event
        if event is not None:
            event.set()
        for fn in list(self._callbacks):
            fn(self)


@dataclass
class SchedulerStats:
    batches: int = 0
    forwards: int = 0
    tokens: int = 0
    queue_wait_s: float = 0.0
    backend_s: float = 0.0
    max_batch_size: int = 0
    errors: int = 0

    def as_dict(self) -> dict[str, Any]:
        b = max(self.batches, 1)
        f = max(self.forwards, 1)
        return {
            "batches": self.batches,
            "forwards": self.forwards,
            "tokens": self.tokens,
            "mean_batch_size": self.forwards / b,
            "mean_batch_tokens": self.tokens / b,
            "max_batch_size": self.max_batch_size,
            "mean_queue_wait_ms": 1000 * self.queue_wait_s / f,
            "mean_backend_ms": 1000 * self.backend_s / b,
            "backend_errors": self.errors,
        }


@dataclass
class _Footprint:
    """Pages a queued forward reads and writes, for the same-batch conflict check."""

    reads: set[int] = field(default_factory=set)
    writes: set[int] = field(default_factory=set)


def _footprint(req: ForwardRequest, page_size: int) -> _Footprint:
    total = (len(req.pages) - 1) * page_size + req.last_page_len
    first_written = (total - len(req.tokens)) // page_size
    return _Footprint(set(req.pages), set(req.pages[first_written:]))


ForwardFn = Callable[[list[ForwardRequest]], list[list[OutputResult]]]


class Scheduler:
    """Collects forwards from instance threads and runs them in batches on its own thread.

    The thread is the backend's home: `call(fn)` runs other backend work there too (the host
    loads the model through it). Measured on CPU: torch forwards run ~15-20% slower on a thread
    other than the one that loaded the model.
    """

    def __init__(self, forward: ForwardFn | None, page_size: int, policy: str = "adaptive",
                 max_batch_tokens: int = 10240, k: int = 8, t_ms: float = 16.0,
                 launch_grace_s: float = 0.05) -> None:
        self._forward = forward
        self._page_size = page_size
        self.policy = policy
        self.max_batch_tokens = max_batch_tokens
        self.k = k
        self.t_s = t_ms / 1000
        self.launch_grace_s = launch_grace_s
        self.stats = SchedulerStats()
        self._queue: list[ForwardFuture] = []
        self._cv = threading.Condition()
        self._stopped = False
        # adaptive: owners whose next forward is due soon (last batch's owners, new launches),
        # each with the time after which the scheduler stops waiting for it
        self._expect: dict[str, float] = {}
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._thread = threading.Thread(target=self._loop, name="pie-scheduler", daemon=True)
        self._thread.start()

    def bind(self, forward: ForwardFn, page_size: int) -> None:
        """Set the backend's forward (when it was created through `call`)."""
        self._forward, self._page_size = forward, page_size

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between batches; returns its result or raises its error."""
        fut: Future[Any] = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler is stopped")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut.result()

    def submit(self, request: ForwardRequest, owner: str) -> ForwardFuture:
        if self._forward is None:
            raise RuntimeError("scheduler has no backend yet")
        fut = ForwardFuture(request, owner)
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler is stopped")
            self._queue.append(fut)
            self._expect.pop(owner, None)
            self._cv.notify()
        return fut

    def expect(self, owner: str) -> None:
        """A new instance will submit soon: adaptive holds a batch for it up to `launch_grace_s`."""
        if self.policy != "adaptive":
            return
        with self._cv:
            self._expect[owner] = time.perf_counter() + self.launch_grace_s

    def forget(self, owner: str) -> None:
        """An instance ended or blocked on something other than a forward: don't wait for it."""
        if owner not in self._expect:  # lock-free fast path: called each time an instance blocks
            return
        with self._cv:
            if self._expect.pop(owner, None) is not None:
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=5)
        for fut in self._queue:
            fut._finish(None, RuntimeError("host is shutting down"))
        self._queue.clear()
        for _fn, cfut in self._calls:
            cfut.set_exception(RuntimeError("host is shutting down"))
        self._calls.clear()

    def _ready(self) -> bool:
        if not self._queue:
            return False
        if self.policy == "adaptive":
            if self._expect:
                now = time.perf_counter()
                self._expect = {o: t for o, t in self._expect.items() if t > now}
            return not self._expect
        if len(self._queue) >= self.k:
            return True
        return time.perf_counter() - self._queue[0].submitted >= self.t_s

    def _wait_s(self) -> float | None:
        """How long the loop may sleep before _ready() can change without a submit."""
        if not self._queue:
            return None
        if self.policy == "adaptive":
            if not self._expect:
                return None
            return max(min(self._expect.values()) - time.perf_counter(), 0.0002)
        return max(self.t_s - (time.perf_counter() - self._queue[0].submitted), 0.0005)

    def _take_batch(self) -> list[ForwardFuture]:
        """Pick queued forwards that can run together; the rest stay queued, in order."""
        batch: list[ForwardFuture] = []
        reads: set[int] = set()
        writes: set[int] = set()
        blocked_owners: set[str] = set()
        rest: list[ForwardFuture] = []
        tokens = 0
        for fut in self._queue:
            req = fut.request
            fp = _footprint(req, self._page_size)
            fits = tokens + len(req.tokens) <= self.max_batch_tokens or not batch
            if (fut.owner in blocked_owners or not fits or fp.reads & writes or fp.writes & reads):
                blocked_owners.add(fut.owner)  # later forwards of this owner wait too (order)
                rest.append(fut)
                continue
            batch.append(fut)
            tokens += len(req.tokens)
            reads |= fp.reads
            writes |= fp.writes
        self._queue = rest
        return batch

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._calls and not self._ready():
                    self._cv.wait(self._wait_s())
                if self._stopped:
                    return
                job = self._calls.popleft() if self._calls else None
                batch = [] if job else self._take_batch()
            if job is not None:
                fn, fut = job
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller of call()
                    fut.set_exception(e)
                continue
            self._run(batch)

    def _run(self, batch: list[ForwardFuture]) -> None:
        start = time.perf_counter()
        st = self.stats
        try:
            assert self._forward is not None  # submit() refuses forwards before bind()
            results = self._forward([f.request for f in batch])
        except Exception as e:  # the backend failed: every forward in this batch fails, host carries on
            log.exception("backend failed on a batch of %d forwards", len(batch))
            st.errors += 1
            err = RuntimeError(f"backend error while running a batch: {type(e).__name__}: {e}")
            for f in batch:
                f._finish(None, err)
            return
        end = time.perf_counter()
        st.batches += 1
        st.forwards += len(batch)
        st.tokens += sum(len(f.request.tokens) for f in batch)
        st.max_batch_size = max(st.max_batch_size, len(batch))
        st.queue_wait_s += sum(start - f.submitted for f in batch)
        st.backend_s += end - start
        if self.policy == "adaptive":
            until = end + min(0.5 * (end - start), 0.02)
            with self._cv:
                for f in batch:
                    self._expect[f.owner] = max(self._expect.get(f.owner, 0.0), until)
        for f, r in zip(batch, results, strict=True):
            f._finish(r, None)
