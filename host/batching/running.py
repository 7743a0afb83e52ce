"""Running a batch: the scheduler's run path, the one every backend takes (`BatchRunner`, the base
of host/batching/scheduler.py's `Scheduler`, which chooses the batches).

A batch is launched through the backend's `start_forward` (`_launch`: a request the backend
rejects fails alone), the loops' next steps are prepared while it runs, and it is waited for
(`_settle`); its outputs finish plain forwards or queue their follow-ups, and feed the loops
(`_after_run`). With a backend that takes a `Feed`, a batch of loops' steps only is waited for
after the next one is launched. A job's end unpins its pages (`_complete`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from gpu_backend.types import Feed, ForwardError, ForwardRequest, OutputResult, StartedForward
from host.batching.future import CopyRequest, ForwardFuture
from host.batching.loops import Loops
from host.batching.policy import BatchPolicy
from host.batching.queue import DECODE_TOKENS, JobQueue, job_pages
from host.batching.stats import SchedulerStats
from host.batching.stepcost import StepCost

__all__ = ["BatchRunner", "CopyFn", "PagePins", "Running", "StartFn", "sent_request"]

log = logging.getLogger(__name__)

StartFn = Callable[..., StartedForward]  # (requests, feed=None)
CopyFn = Callable[[int, int, int, int, int], None]


class PagePins(Protocol):
    """Keeps pages off the free list while a job that touches them is queued or running."""

    def pin(self, pages: Iterable[int]) -> None: ...

    def unpin(self, pages: Iterable[int]) -> None: ...

    def forget_content(self, pages: Sequence[int]) -> None: ...


def sent_request(fut: ForwardFuture) -> ForwardRequest:
    """What a forward job runs in its batch: its request, or the chunk of it taken (host/batching/chunks.py)."""
    ch = fut.chunks
    return fut.request if ch is None or ch.part is None else ch.part  # type: ignore[return-value]


class Running:
    """A launched batch: its handle and what `_settle` needs once it has run."""

    __slots__ = ("handle", "batch", "loops", "ahead", "start", "tokens", "waited", "prefill")

    def __init__(self, handle: StartedForward, batch: list[ForwardFuture], loops: int, ahead: int, start: float,
                 tokens: int, waited: float, prefill: int = 0) -> None:
        self.handle, self.batch, self.loops, self.ahead = handle, batch, loops, ahead
        self.start, self.tokens, self.waited, self.prefill = start, tokens, waited, prefill


class BatchRunner:
    """The run path of the scheduler thread (a part of `Scheduler`: its state is set up there)."""

    policy: BatchPolicy
    stats: SchedulerStats
    cost: StepCost
    _copy: CopyFn | None
    _pins: PagePins | None
    _page_size: int
    _queue: JobQueue
    _start: StartFn | None
    _ahead_in_batch: list[ForwardRequest]
    _loops: Loops
    _loops_in_batch: int
    _fed_rows: list[int]
    _feeds: bool
    _running: Running | None
    _cv: threading.Condition
    _last_end: float
    _auto: bool
    _chunking: bool

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
        reqs.extend(sent_request(f) for f in batch[ahead:] if isinstance(f.request, ForwardRequest))
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
        sent = [(len(sent_request(f).tokens), f.parent is not None or f.chunks is not None) for f in rest
                if isinstance(f.request, ForwardRequest)]
        tokens = loops + sum(n for n, _c in sent)
        prefill = sum(n for n, chunk in sent if chunk or n > DECODE_TOKENS)  # (the rest: decode steps)
        # (counted before the steps change the requests)
        waited = loops * max(start - self._loops.last_batch[1], 0.0) + sum(start - f.submitted for f in rest)
        self._loops.after_launch(batch, ahead, loops)
        running = Running(handle, batch, loops, ahead, start, tokens, waited, prefill)
        lp = self._loops
        if self._feeds and lp.fill and loops == ahead and all(
                f.generation is not None and f.generation.ahead for f in rest):
            lp.feed()  # the next batch goes before this one is waited for
            self._running = running
            return
        self._settle(running, fed=False)

    def _settle(self, run: Running, fed: bool) -> bool:
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
                reqs = [sent_request(f) for f in batch if isinstance(f.request, ForwardRequest)]
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
