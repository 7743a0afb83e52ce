"""The batching scheduler: forwards from all instances merged into backend calls.

One scheduler thread owns the backend: it runs the batches, the KV copies and any other
backend work (`call`). When to fire is the policy's decision (host/batching/policy.py).
Order: a job is never run together with, or ahead of, an earlier queued job of the same owner
or one whose pages it reads or writes; a KV copy runs between batches in that same order.
A request the backend rejects (`ForwardError`) fails alone; the rest of its batch runs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

from gpu_backend.types import Feed, ForwardError, ForwardRequest, OutputResult, StartedForward, started
from host.batching.future import CopyRequest, ForwardFuture, Job
from host.batching.generation import Generation
from host.batching.loops import Loops
from host.batching.policy import AdaptivePolicy, BatchPolicy
from host.batching.queue import DECODE_TOKENS, JobQueue, decode_tokens, job_pages
from host.batching.stats import BATCH_SIZE_BUCKETS, SchedulerStats
from host.batching.stepcost import DEFAULT_RATIO, StepCost
from host.levels import DEFAULT_AGING_S, LevelStats, Turns

__all__ = ["Scheduler", "SchedulerStats", "ForwardFn", "StartFn", "CopyFn", "BATCH_SIZE_BUCKETS"]

log = logging.getLogger(__name__)

ForwardFn = Callable[[Sequence[ForwardRequest]], list[list[OutputResult]]]
StartFn = Callable[..., StartedForward]  # (requests, feed=None)
CopyFn = Callable[[int, int, int, int, int], None]


class PagePins(Protocol):
    """Keeps pages off the free list while a job that touches them is queued or running."""

    def pin(self, pages: Iterable[int]) -> None: ...

    def unpin(self, pages: Iterable[int]) -> None: ...

    def forget_content(self, pages: Sequence[int]) -> None: ...


def _sent(fut: ForwardFuture) -> ForwardRequest:
    """What a forward job runs in its batch: its request, or the chunk of it taken (host/batching/chunks.py)."""
    ch = fut.chunks
    return fut.request if ch is None or ch.part is None else ch.part  # type: ignore[return-value]


class _Running:
    """A launched batch: its handle and what `_settle` needs once it has run."""

    __slots__ = ("handle", "batch", "loops", "ahead", "start", "tokens", "waited", "prefill")

    def __init__(self, handle: StartedForward, batch: list[ForwardFuture], loops: int, ahead: int, start: float,
                 tokens: int, waited: float, prefill: int = 0) -> None:
        self.handle, self.batch, self.loops, self.ahead = handle, batch, loops, ahead
        self.start, self.tokens, self.waited, self.prefill = start, tokens, waited, prefill


class Scheduler:
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
        self._running: _Running | None = None  # a batch launched and not yet waited for (fed)
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
        budget = None
        if self._auto and fire and self._queue:  # prefill tokens this batch may take (stepcost.py)
            decodes, prefill = decode_tokens(self._queue.jobs)
            if prefill:  # (else nothing to cap, and no fit to make)
                budget = self.cost.prefill_budget(len(loops) + decodes, self.max_batch_tokens)
                self.stats.prefill_budget = self.cost.budget
                self.stats.step_fixed_ms, self.stats.step_token_us = self.cost.fit_ms_us()
            else:
                budget = self.max_batch_tokens
        chosen = self._queue.choose(len(loops), self.max_batch_tokens, self._chunk, self.turns, now, budget) \
            if fire and self._queue else None
        copies, queued = self._queue.take(fire, loops, self._page_size, self.max_batch_tokens, dry, self._chunk,
                                          chosen, budget)
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
                got[f.tenant] = got.get(f.tenant, 0) + len(_sent(f).tokens)
            self.turns.served(got)
            aged = sum(1 for p, _t, w in waits if w >= self.turns.aging_s)
            if aged:
                self.levels.promoted(aged)

    def _run_copy(self, fut: ForwardFuture) -> None:
        c = fut.request
        assert isinstance(c, CopyRequest) and self._copy is not None  # the host binds copy with forward
        try:
            self._copy(c.src_page, c.src_offset, c.dst_page, c.dst_offset, c.count)
        except Exception as e:  # fails this copy only
            log.exception("backend failed on a KV copy for %s", c.name)
            self.stats.errors += 1
            self._complete(fut, None, RuntimeError(f"backend error in copy-tokens: {type(e).__name__}: {e}"))
            return
        self.stats.copies += 1
        self._complete(fut, None, None)

    def _run(self, batch: list[ForwardFuture]) -> None:
        """Run one batch: launch it (`start_forward`; a backend that cannot overlap runs it right
        there), then do what the last one left while this one runs (its loops' steps: take the
        token each launched step writes and prepare the step after; end the loops left out of this
        batch: `Loops.after_launch`), then wait for it (`_settle`). When it returns, every loop whose
        next step is prepared goes into the next batch as soon as its token is written in
        (`Loops.fill_ahead`): between two backend calls the host does that, the plain forwards'
        turns and the steps of loops that cannot run ahead (a grammar's mask needs the token), not
        every loop's bookkeeping. A request the backend rejects at the launch fails alone; a batch
        that fails after it fails whole.

        Fed (a backend that takes a `Feed`; `_feeds`): a batch of loops' steps only is not waited
        for here: the next batch, their next steps, is launched first, each step's token read on
        the device from its row of this one (`Loops.feed`), and this one is waited for after that
        launch. The device then never waits for the host between two steps; the stop checks run
        one step behind (a loop that drew a stop token has one step more launched, whose K/V
        slot, past its end, is given back: `Loops.wasted`), as SGLang's overlap scheduler does."""
        reqs, loops = self._ahead_in_batch, self._loops_in_batch  # batch[:ahead]: loops run ahead, reqs theirs
        fed, prev = self._fed_rows, self._running
        ahead = len(reqs)
        self._ahead_in_batch, self._loops_in_batch, self._fed_rows, self._running = [], 0, [], None
        reqs.extend(_sent(f) for f in batch[ahead:] if isinstance(f.request, ForwardRequest))
        launched = self._launch(batch, reqs, loops, ahead, prev.handle if prev is not None and fed else None, fed)
        prev_ok = prev is None or self._settle(prev, fed=bool(fed))  # (the batch this one's steps read)
        if launched is None:
            return
        handle, start, loops, ahead = launched
        if not prev_ok:  # it failed, and the loops fed from it with it: this batch's steps of theirs are skipped
            for f in batch[:ahead]:
                if f.done():
                    self._loops.wasted[id(f)] = (f, None)
        rest = batch[loops:]
        sent = [(len(_sent(f).tokens), f.parent is not None or f.chunks is not None) for f in rest
                if isinstance(f.request, ForwardRequest)]
        tokens = loops + sum(n for n, _c in sent)
        prefill = sum(n for n, chunk in sent if chunk or n > DECODE_TOKENS)  # (the rest: decode steps)
        # (counted before the steps change the requests)
        waited = loops * max(start - self._loops.last_batch[1], 0.0) + sum(start - f.submitted for f in rest)
        self._loops.after_launch(batch, ahead, loops)
        running = _Running(handle, batch, loops, ahead, start, tokens, waited, prefill)
        lp = self._loops
        if self._feeds and lp.fill and loops == ahead and all(
                f.generation is not None and f.generation.ahead for f in rest):
            lp.feed()  # the next batch goes before this one is waited for
            self._running = running
            return
        self._settle(running, fed=False)

    def _settle(self, run: _Running, fed: bool) -> bool:
        """Wait for a launched batch and take its outputs (`_after_run`); False if it failed. `fed`:
        the next batch, which holds its loops' next steps, has been launched already."""
        try:
            results = run.handle.wait()
        except Exception as e:
            lp = self._loops
            lp.fill.clear()
            lp.lasts.clear()
            lp.broken.clear()
            if lp.wasted:  # their step in this batch was their last
                for f, _t in lp.wasted.values():
                    if not f.done():
                        self._complete(f, None, RuntimeError(f"backend error while running a batch: {e}"))
                lp.wasted = {}
            self._fail([f for f in run.batch if not f.done()], e)
            return False
        end = time.perf_counter()
        # the batch's own time: a device runs its queue in order, so from the last one's end if later
        self.cost.observe(run.tokens, end - max(run.start, self._last_end), run.prefill)
        self._last_end = end
        self._after_run(run.batch, results, getattr(run.handle, "tokens", None), run.loops, run.ahead, run.start,
                        end, fed)
        self.stats.record(len(run.batch), run.tokens, run.waited, run.start, end)
        return True

    def _launch(self, batch: list[ForwardFuture], reqs: list[ForwardRequest], loops: int, ahead: int,
                source: StartedForward | None = None,
                fed: list[int] | None = None) -> tuple[StartedForward, float, int, int] | None:
        """Start the batch; a request the backend rejects fails alone and the rest is started without
        it (`batch` shrinks). `source`: the batch running, whose rows `fed` the first loops' tokens
        are read from. Returns the handle, the launch time and the loops / ahead counts left, or
        None when nothing could be started."""
        assert self._start is not None
        fed = list(fed or ())
        while True:
            start = time.perf_counter()
            try:
                if source is not None and fed:
                    return self._start(reqs, Feed(source, range(len(fed)), fed)), start, loops, ahead
                return self._start(reqs), start, loops, ahead
            except ForwardError as e:
                i = e.request_index
                if not 0 <= i < len(batch):
                    self._fail(batch, e)
                    self._loops.end_finals(hold=True)
                    return None
                self.stats.errors += 1
                loops -= int(i < loops)
                ahead -= int(i < ahead)
                if i < len(fed):
                    del fed[i]
                self._complete(batch.pop(i), None, e)
                reqs = [_sent(f) for f in batch if isinstance(f.request, ForwardRequest)]
                if not batch:
                    self._loops.end_finals(hold=True)
                    return None
            except Exception as e:  # the backend failed: every forward in this batch fails, host carries on
                self._fail(batch, e)
                self._loops.end_finals(hold=True)
                return None

    def _after_run(self, batch: list[ForwardFuture], results: list[list[OutputResult]],
                   drawn: list[int | None] | None, loops: int, ahead: int, start: float, end: float,
                   fed: bool = False) -> None:
        """The batch has run: plain forwards finish (or queue their follow-up), the loops' drawn
        tokens go into their prepared steps (`fed`: launched already), the loops that cannot run
        ahead take their step."""
        if self._chunking:
            self._chunks_ran(batch, results, loops)
        rest, rest_results = batch[loops:], results[loops:]
        come_back: list[str] = []
        follow_ups: list[ForwardFuture] = []
        unpin: list[int] = []
        for f, r in zip(rest, rest_results, strict=True):
            if f.generation is None and f.parent is None:  # (a chunk, not the last: its forward stays queued)
                nxt = self._follow_up(f, r) if f.follow is not None else None
                if nxt is None:
                    unpin.extend(job_pages(f.request))
                    come_back.append(f.owner)
                else:
                    follow_ups.append(nxt)
        if follow_ups:
            with self._cv:
                self._queue.extend(follow_ups)
                self.stats.lookaheads += len(follow_ups)
        if self._pins is not None and unpin:
            self._pins.unpin(unpin)
        self._expect(come_back, start, end)
        ended: list[str] = []
        lp = self._loops
        lp.fill_ahead(results, drawn, fed)
        if ahead < loops:
            lp.step_loops(batch, results, loops, end, ended, first=ahead)
        for f in lp.broken:  # a host bug in a loop's step: it ends now that its last step has run
            self._complete(f, None, RuntimeError("host error in generate: a step could not be prepared"))
            ended.append(f.owner)
        lp.broken.clear()
        for f, r in zip(rest, rest_results, strict=True):
            gen = f.generation
            if gen is None:
                f.finish(r, None)
            elif not gen.ahead and lp.step(f, gen, r, end):  # (a first step run ahead: in fill)
                ended.append(f.owner)
        if ended and not lp.resident and not lp.ahead and not fed:  # (fed: loops run in the next batch)
            self._expect(ended, start, end)
        lp.last_batch = (start, end)

    def _chunks_ran(self, batch: list[ForwardFuture], results: list[list[OutputResult]], loops: int) -> None:
        """Chunked forwards' chunks have run: each one's outputs are kept; a last chunk's row of
        `results` becomes every output its forward's chunks produced, in the order asked. (A chunk
        that was not the last stays in `batch`, ending nothing: its forward stays queued, pinned.)"""
        st = self.stats
        for i in range(loops, len(batch)):
            f = batch[i]
            ch = f.chunks if f.parent is None else f.parent.chunks
            if ch is None or ch.part is None:
                continue
            st.prefill_chunks += 1
            st.chunked_prefills += ch.done == 0
            merged = ch.ran(results[i])
            if f.parent is None:  # the last chunk
                f.chunks = None
                results[i] = merged

    def _follow_up(self, fut: ForwardFuture, outputs: list[OutputResult]) -> ForwardFuture | None:
        """The owner's next forward, if `fut.follow` makes one (on `fut`'s pages: it takes over their pins)."""
        follow, fut.follow = fut.follow, None
        assert follow is not None
        try:
            nxt = follow(fut, outputs)
        except Exception:  # a host bug: no follow-up; the owner submits its next forward itself
            log.exception("follow-up of a forward of %s failed", fut.owner)
            return None
        return nxt

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

    def _fail(self, batch: list[ForwardFuture], e: Exception) -> None:
        log.error("backend failed on a batch of %d forwards: %s: %s", len(batch), type(e).__name__, e)
        self.stats.errors += 1
        err = RuntimeError(f"backend error while running a batch: {type(e).__name__}: {e}")
        for f in batch:
            self._complete(f, None, err)

    def _complete(self, fut: ForwardFuture, result: Any, error: BaseException | None) -> None:
        """End a job: its pages may become free again, then its waiter wakes. A chunk that is not its
        forward's last ends nothing unless it failed: then its forward fails, and leaves the queue."""
        parent = fut.parent
        if parent is not None:
            fut.finish(result, error)
            if error is not None and not parent.done():
                with self._cv:
                    self._queue.remove(parent)
                self._complete(parent, None, error)
            return
        if fut.generation is not None:  # what the loop's steps wrote is noted first
            try:
                fut.generation.note_writes()
            except Exception:  # a host bug: the pages' content is forgotten below instead
                log.exception("generation loop of %s could not note its writes", fut.owner)
                error = error or RuntimeError("host error in generate: its writes could not be noted")
        if self._pins is not None:
            if error is not None:  # what the job wrote is unknown: the prefix cache must not trust it
                job = fut.request
                written = [job.dst_page] if isinstance(job, CopyRequest) else \
                    job.pages[job.first_written_page(self._page_size):]
                self._pins.forget_content(written)
            self._pins.unpin(job_pages(fut.request))
        fut.finish(result, error)

    def _expect(self, owners: list[str], start: float, end: float) -> None:
        """Tell the policy whose next forward the batch that ran from `start` to `end` is waiting for."""
        if owners:
            with self._cv:
                self.policy.batch_done(owners, start, end)
