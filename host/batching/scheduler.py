"""The batching scheduler: forwards from all instances merged into backend calls.

One scheduler thread owns the backend: it runs the batches, the KV copies and any other
backend work (`call`). When to fire is the policy's decision (host/batching/policy.py).
Order: a job is never run together with, or ahead of, an earlier queued job of the same owner
or one whose pages it reads or writes; a KV copy runs between batches in that same order.
A request the backend rejects (`ForwardError`) fails alone; the rest of its batch runs.
Here: the jobs' intake, the thread and the choice of each batch; running a batch (launch, wait,
outputs, loops' steps) is host/batching/running.py's `BatchRunner`, the scheduler's base.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from gpu_backend.types import ForwardRequest, OutputResult, started
from host.batching.future import CopyRequest, ForwardFuture, Job
from host.batching.generation import Generation
from host.batching.loops import Loops
from host.batching.policy import AdaptivePolicy, BatchPolicy
from host.batching.queue import JobQueue, decode_tokens, job_pages
from host.batching.running import BatchRunner, CopyFn, PagePins, Running, StartFn, sent_request
from host.batching.stats import BATCH_SIZE_BUCKETS, SchedulerStats
from host.batching.stepcost import DEFAULT_RATIO, StepCost
from host.levels import DEFAULT_AGING_S, LevelStats, Turns

__all__ = ["Scheduler", "SchedulerStats", "ForwardFn", "StartFn", "CopyFn", "BATCH_SIZE_BUCKETS"]  # (StartFn: running.py)

log = logging.getLogger(__name__)

ForwardFn = Callable[[Sequence[ForwardRequest]], list[list[OutputResult]]]


class Scheduler(BatchRunner):
    """Collects jobs from instance threads and runs them on its own thread.

    The thread is the backend's home: `call(fn)` runs other backend work there too (the host
    loads the model through it). Measured on CPU: torch forwards run ~15-20% slower on a thread
    other than the one that loaded the model.
    """

    def __init__(self, policy: BatchPolicy | None = None, max_batch_tokens: int = 10240,
                 prefill_chunk: int | str = 0, aging_s: float = DEFAULT_AGING_S,
                 prefill_ratio: float = DEFAULT_RATIO) -> None:
        self.policy = policy or AdaptivePolicy()
        self.max_batch_tokens = max_batch_tokens
        # a forward of more new tokens runs in chunks of at most this many, one batch each, so the
        # running loops step between them (host/batching/chunks.py); 0 = never split; "auto": sized
        # per batch from the measured step cost (host/batching/stepcost.py), `prefill_ratio` its bound
        self.stats = SchedulerStats()
        self.cost = StepCost(prefill_ratio)  # the running fit of a batch's time on its tokens
        self._last_end = 0.0  # when the last batch waited for ended (a batch's time starts no earlier)
        self.set_prefill_chunk(prefill_chunk)
        # service levels (host/levels.py): each owner's (priority, tenant), set by the host; a full
        # batch takes queued forwards in their order; waits counted per priority and tenant
        self._classes: dict[str, tuple[int, str]] = {}
        self.turns = Turns(aging_s)
        self.levels = LevelStats()
        self._forward: ForwardFn | None = None
        self._copy: CopyFn | None = None
        self._pins: PagePins | None = None
        self._page_size = 1
        self._queue = JobQueue()
        self._start: StartFn | None = None
        self._ahead_in_batch: list[ForwardRequest] = []  # the batch being taken starts with these (_take -> _run)
        self._loops = Loops(self._complete, self._expect)  # the generation loops' steps (host/batching/loops.py)
        self._batch_running = False  # a batch is in the backend (set and cleared by the scheduler thread)
        self._loops_in_batch = 0  # the batch being taken starts with this many resident loops (_take -> _run)
        self._fed_rows: list[int] = []  # its first loops' rows in the batch running (_take -> _run, fed)
        self._feeds = False  # the backend takes a `Feed`: batches of loops only are launched one ahead
        self._running: Running | None = None  # a batch launched and not yet waited for (fed)
        self._cv = threading.Condition()
        self._stopped = False
        self.backend: Any = None  # the backend object itself, for `call` work (embeddings, host/api/embed.py)
        self._calls: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._thread = threading.Thread(target=self._loop, name="pie-scheduler", daemon=True)
        self._thread.start()

    def bind(self, forward: ForwardFn, copy: CopyFn | None, page_size: int, pins: PagePins | None = None,
             start: StartFn | None = None, feeds: bool = False) -> None:
        """Attach the backend (its forward and copy_tokens, and its page size) and the page pins;
        `start`: its `start_forward` (a backend that cannot overlap: None, and its `forward` is run
        through `gpu_backend.types.started`). Every backend takes the same run path (`_run`).
        `feeds`: `start` takes a `gpu_backend.types.Feed` (the loops' steps then go one batch ahead)."""
        self._forward, self._copy, self._page_size, self._pins = forward, copy, page_size, pins
        self._start = start if start is not None else (lambda reqs, f=forward: started(f(reqs)))
        self._feeds = feeds and start is not None

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the scheduler thread between batches; returns its result or raises its error."""
        return self.call_soon(fn).result()

    def call_soon(self, fn: Callable[[], Any]) -> Future[Any]:
        """`call` without waiting: the future of `fn`'s result."""
        fut: Future[Any] = Future()
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler is stopped")
            self._calls.append((fn, fut))
            self._cv.notify()
        return fut

    def submit(self, request: Job, owner: str, generation: Generation | None = None,
               lookahead: bool = False) -> ForwardFuture:
        """Queue a forward (a checked ForwardRequest) or a KV copy for `owner`; returns its future.

        With `generation` (whose `request` this is), the forward is the first step of a host-side
        loop: the future completes with the loop's result when it ends. `lookahead`: a predicted
        step its owner has not asked for yet (counted in `stats.lookaheads`, like follow-ups)."""
        if self._forward is None:
            raise RuntimeError("scheduler has no backend yet")
        fut = ForwardFuture(request, owner, generation)
        cls = self._classes.get(owner)
        if cls is not None:
            fut.priority, fut.tenant = cls
        with self._cv:
            if self._stopped:
                raise RuntimeError("scheduler is stopped")
            if self._pins is not None:
                self._pins.pin(job_pages(request))
            idle = self._no_forwards()
            self._queue.append(fut)
            self.stats.lookaheads += lookahead
            self.policy.submitted(owner)
            # Wake the scheduler only when this submit can change its decision: it may be asleep
            # with nothing to fire (no timeout), a copy may run now, or the batch is ready. A wake-up
            # for every submit of a step costs each one a GIL round trip on the scheduler thread.
            if idle or isinstance(request, CopyRequest) or self.policy.ready(self._pending(), time.perf_counter()):
                self._cv.notify()
        return fut

    def set_prefill_chunk(self, chunk: int | str) -> None:
        """`--prefill-chunk`: an int >= 0 (0 = never split) or "auto"."""
        if chunk != "auto" and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0):
            raise ValueError(f"prefill_chunk must be an int >= 0 or 'auto', got {chunk!r}")
        self.prefill_chunk = chunk
        self._auto = chunk == "auto"
        self._chunk = 0 if self._auto else int(chunk)
        self._chunking = self._auto or self._chunk > 0

    def set_class(self, owner: str, priority: int, tenant: str) -> None:
        """`owner`'s service level from its next job on (host/levels.py; a checked priority)."""
        self._classes[owner] = (priority, tenant)

    def drop_class(self, owner: str) -> None:
        self._classes.pop(owner, None)

    def level_stats(self) -> dict[str, Any]:
        """Waits and aged promotions per priority and tenant, with the queue's depth now."""
        with self._cv:
            depth = [(f.priority, f.tenant) for f in self._queue.jobs if not isinstance(f.request, CopyRequest)]
        return self.levels.as_dict(depth)

    def busy(self) -> bool:
        """Whether forwards are queued or generation loops are running (read without the lock)."""
        return bool(self._queue or self._loops.resident or self._loops.ahead or self._running)

    def expect(self, owner: str) -> None:
        """A new instance will submit soon. The policy may hold a batch for it only while nothing
        else is under way (launches that come together at an idle host prefill together); with forwards or
        loops running, the newcomer joins whichever batch comes next, instead of holding the
        running ones until it submits (measured: 32 loops running, a launch every 25 ms: batch
        gaps of up to 3-11 ms, 0.4-0.9 ms on average, vs ~0.3 ms without the hold)."""
        with self._cv:
            if not (self._queue or self._loops.resident or self._loops.ahead or self._batch_running):
                self.policy.launched(owner, time.perf_counter())

    def forget(self, owner: str) -> None:
        """An instance ended or blocked on something other than a forward: don't wait for it."""
        if not self.policy.expects(owner):  # lock-free fast path: called each time an instance blocks
            return
        with self._cv:
            if self.policy.forget(owner):
                self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        self._thread.join(timeout=5)
        lp = self._loops
        for fut in (self._queue.clear() + lp.ahead + lp.resident + [f for f, _t, _p in lp.finals]
                    + [f for f, _t in lp.wasted.values()]):
            if not fut.done():
                self._complete(fut, None, RuntimeError("host is shutting down"))
        lp.wasted.clear()
        lp.ahead_rows.clear()
        self._loops.ahead.clear()
        self._loops.ahead_reqs.clear()
        self._loops.resident.clear()
        self._loops.finals.clear()
        for _fn, cfut in self._calls:
            cfut.set_exception(RuntimeError("host is shutting down"))
        self._calls.clear()

    # ---- the scheduler thread ----
    def _loop(self) -> None:
        while True:
            with self._cv:
                settle = False
                while not self._stopped and not self._calls and not self._has_work():
                    # no batch to launch now: the one running is waited for (its loops' steps are
                    # launched known, or end), and the loops left out of the last one end
                    if self._running is not None or self._loops.finals:
                        settle = True
                        break
                    self._cv.wait(self._wait_s())
                if settle:
                    job, copies, batch = None, list[ForwardFuture](), list[ForwardFuture]()
                elif self._stopped:
                    job, copies, batch = None, [], []
                else:
                    job = self._calls.popleft() if self._calls else None
                    copies, batch = ([], []) if job else self._take()
                    self._batch_running = bool(batch) or self._running is not None
            if self._running is not None and (settle or self._stopped or job is not None):
                self._loops.unfeed()  # (a call runs with no batch in flight)
                running, self._running = self._running, None
                self._settle(running, fed=False)
                self._batch_running = False
                if settle or self._stopped:
                    continue
            if settle:
                self._loops.end_finals(hold=True)
                continue
            if self._stopped:
                return
            if job is not None:
                fn, cfut = job
                try:
                    cfut.set_result(fn())
                except BaseException as e:  # handed to the caller of call()
                    cfut.set_exception(e)
                continue
            for c in copies:
                self._run_copy(c)
            if batch:
                self._run(batch)
                self._batch_running = self._running is not None

    def _no_forwards(self) -> bool:
        """Nothing to put in a batch: no queued forward (copies aside) and no loop (lock held)."""
        return self._queue.no_forwards() and not self._loops.resident and not self._loops.ahead

    def _pending(self) -> list[ForwardFuture]:
        """What the policy looks at: the resident loops (always ready) and the queue."""
        if self._loops.ahead:
            return self._loops.ahead + self._loops.resident + self._queue.jobs
        return self._loops.resident + self._queue.jobs if self._loops.resident else self._queue.jobs

    def _forwards_ready(self) -> bool:
        if self._no_forwards():
            return False
        return self.policy.ready(self._pending(), time.perf_counter())

    def _has_work(self) -> bool:
        return self._forwards_ready() or (self._queue.copies > 0 and bool(self._take(dry=True)[0]))

    def _wait_s(self) -> float | None:
        if self._no_forwards():
            return None
        return self.policy.wait_s(self._pending(), time.perf_counter())

    def _take(self, dry: bool = False) -> tuple[list[ForwardFuture], list[ForwardFuture]]:
        """Runnable copies and the next batch of forwards (the running loops' steps first, then the
        queued forwards that may join them: host/batching/queue.py); everything else stays queued."""
        fire = self._forwards_ready()
        loops: list[ForwardFuture] = []
        if fire and (self._loops.resident or self._loops.ahead):
            loops = self._loops.ahead + self._loops.resident
            if not dry:
                lp = self._loops
                self._ahead_in_batch, self._fed_rows = lp.ahead_reqs, lp.ahead_rows
                lp.ahead, lp.ahead_reqs, lp.ahead_rows, lp.resident = [], [], [], []
                self._loops_in_batch = len(loops)
        now = time.perf_counter()
        budget = share = None
        if self._auto and fire and self._queue:  # prefill tokens this batch may take (stepcost.py)
            decodes, prefills = decode_tokens(self._queue.jobs)
            if prefills:  # (else nothing to cap, and no fit to make)
                # each prefill that could join gets the ratio's budget (`share`), not one budget for
                # all of them: with one shared, prefills of several owners queued at once ran one
                # share a batch, so while any decode ran the prefills got at most (ratio - 1) /
                # ratio of the backend's time, and a load whose prefills need more (agents on the
                # model on CPU: ~half of it) queued them without bound (bench/agent_io.md)
                share = self.cost.prefill_budget(len(loops) + decodes, self.max_batch_tokens)
                budget = min(share * prefills, max(self.max_batch_tokens - len(loops) - decodes, 1))
                self.stats.prefill_budget = self.cost.budget
                self.stats.step_fixed_ms, self.stats.step_token_us = self.cost.fit_ms_us()
            else:
                budget = self.max_batch_tokens
        chosen = self._queue.choose(len(loops), self.max_batch_tokens, self._chunk, self.turns, now, budget, share) \
            if fire and self._queue else None
        copies, queued = self._queue.take(fire, loops, self._page_size, self.max_batch_tokens, dry, self._chunk,
                                          chosen, budget, share)
        if not dry and queued:
            self._waited(queued, now, chosen is not None)
        return copies, loops + queued

    def _waited(self, taken: list[ForwardFuture], now: float, full: bool) -> None:
        """Count the waits of the queued forwards taken (a chunk: when its forward's first is); with
        `full` (the batch was chosen by service level) the tenants served and the aged promotions."""
        waits = [(f.priority, f.tenant, now - f.submitted) for f in taken
                 if (ch := (f.parent or f).chunks) is None or ch.done == 0]
        self.levels.waited_many(waits)
        if full:
            got: dict[str, int] = {}
            for f in taken:
                got[f.tenant] = got.get(f.tenant, 0) + len(sent_request(f).tokens)
            self.turns.served(got)
            aged = sum(1 for p, _t, w in waits if w >= self.turns.aging_s)
            if aged:
                self.levels.promoted(aged)

    def withdraw(self, fut: ForwardFuture) -> bool:
        """Take back a queued forward before it runs (a follow-up its owner did not want): True if it
        was still queued (it then fails with an error nobody waits for), False if running or done."""
        with self._cv:
            if not self._queue.remove(fut):
                return False
            self.stats.lookaheads_withdrawn += 1
        if self._pins is not None:  # it wrote nothing: what the pages hold is still known
            self._pins.unpin(job_pages(fut.request))
        fut.finish(None, RuntimeError("withdrawn before it ran"))
        return True
