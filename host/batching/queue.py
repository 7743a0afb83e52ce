"""The scheduler's queue: jobs waiting to run, and which of them may join the next batch.

Order: a job is never run together with, or ahead of, an earlier queued job of the same owner or
one whose pages it reads or writes; a KV copy runs between batches in that same order, before the
batch when nothing ahead of it touches its pages. Lock-free: the scheduler holds its lock around
every call.

When the queued forwards do not all fit in the batch (`choose`), which of them join it follows the
service levels (host/levels.py): higher priority first, aged waiters first of all, tenants in turn
within a priority; the order rules above still hold (a forward chosen behind one of its owner's
or a conflicting job that stays queued stays queued too).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gpu_backend.types import ForwardRequest
from host.batching.chunks import Chunks
from host.batching.future import CopyRequest, ForwardFuture, Job
from host.levels import Turns

__all__ = ["JobQueue", "job_pages", "footprint", "DECODE_TOKENS", "decode_tokens"]

DECODE_TOKENS = 16  # with `--prefill-chunk auto`: a forward of at most this many new tokens is a decode step


def _split(chunk: int, budget: int | None) -> int:
    """Forwards of more new tokens than this run in chunks (0: none): `chunk`, or with a prefill
    `budget` (`--prefill-chunk auto`) every forward longer than a decode step."""
    return DECODE_TOKENS if budget is not None else chunk


def decode_tokens(jobs: Iterable[ForwardFuture]) -> tuple[int, int]:
    """The new tokens of the queued decode steps among `jobs`, and how many prefills (longer
    forwards) could join the next batch: those queued with no chunk of theirs in flight
    (`--prefill-chunk auto`: each of them gets a prefill budget of its own)."""
    n = prefills = 0
    for f in jobs:
        req = f.request
        if isinstance(req, ForwardRequest):
            if f.chunks is None and len(req.tokens) <= DECODE_TOKENS:
                n += len(req.tokens)
            elif f.chunks is None or not f.chunks.running:
                prefills += 1
    return n, prefills


def job_pages(job: Job) -> list[int]:
    """Every page a job touches (what stays pinned while it is queued or running)."""
    if isinstance(job, CopyRequest):
        return [job.src_page, job.dst_page]
    return job.pages


def footprint(job: Job, page_size: int) -> tuple[set[int], set[int]]:
    """Pages a job reads and writes."""
    if isinstance(job, CopyRequest):
        return {job.src_page}, {job.dst_page}
    return set(job.pages), set(job.pages[job.first_written_page(page_size):])


class JobQueue:
    """Queued forwards and copies, in submission order."""

    def __init__(self) -> None:
        self.jobs: list[ForwardFuture] = []
        self.copies = 0  # how many of `jobs` are copies

    def __len__(self) -> int:
        return len(self.jobs)

    def __bool__(self) -> bool:
        return bool(self.jobs)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.jobs)

    def no_forwards(self) -> bool:
        return len(self.jobs) <= self.copies

    def append(self, fut: ForwardFuture) -> None:
        self.jobs.append(fut)
        if isinstance(fut.request, CopyRequest):
            self.copies += 1

    def extend(self, futs: Iterable[ForwardFuture]) -> None:
        for f in futs:
            self.append(f)

    def remove(self, fut: ForwardFuture) -> bool:
        """Take `fut` out if it is still queued (a forward only: copies are never withdrawn)."""
        try:
            self.jobs.remove(fut)
        except ValueError:
            return False
        return True

    def clear(self) -> list[ForwardFuture]:
        jobs, self.jobs, self.copies = self.jobs, [], 0
        return jobs

    def choose(self, ahead: int, max_tokens: int, chunk: int, turns: Turns, now: float,
               budget: int | None = None, share: int | None = None) -> dict[ForwardFuture, int] | None:
        """The queued forwards a batch after `ahead` tokens should take when they do not all fit in
        `max_tokens`, or the chunked ones not in their share (`chunk`, or with `--prefill-chunk auto`
        the batch's prefill `budget`) (None: they do), in the service levels' order (`turns`); a
        forward whose owner has one left out before it is left out too (its order). Each chosen one
        with the tokens it may take (a chunked one: its part of the share, in that order). `share`
        (with a `budget`): what one chunked forward may take of it at most."""
        costs: dict[ForwardFuture, int] = {}
        split = _split(chunk, budget)
        cap = budget if budget is not None else chunk
        each = share if share is not None and budget is not None else cap
        chunked: set[ForwardFuture] = set()
        total, pre = ahead, 0
        for f in self.jobs:
            req = f.request
            if isinstance(req, CopyRequest):
                continue
            n = len(req.tokens) - (f.chunks.done if f.chunks is not None else 0)
            if split and req.embeds is None and (f.chunks is not None or n > split):
                chunked.add(f)
                n = min(n, cap, each)
                pre += n
            costs[f] = n
            total += n
        if total <= max_tokens and pre <= cap:
            return None
        chosen: dict[ForwardFuture, int] = {}
        left: set[str] = set()
        tokens, used = ahead, 0
        for f in turns.order(list(costs), lambda f: f.priority, lambda f: f.tenant, lambda f: f.submitted, now):
            if f in chunked:  # it takes what is left of the share (a chunk of it), if anything is
                n = min(costs[f], cap - used, max_tokens - tokens if chosen or ahead else costs[f])
                if f.owner not in left and n > 0:
                    chosen[f] = n
                    tokens += n
                    used += n
                    continue
            elif f.owner not in left and (tokens + costs[f] <= max_tokens or not (chosen or ahead)):
                chosen[f] = costs[f]
                tokens += costs[f]
                continue
            left.add(f.owner)
        return chosen

    def take(self, fire: bool, ahead: Sequence[ForwardFuture], page_size: int, max_tokens: int,
             dry: bool = False, chunk: int = 0, chosen: dict[ForwardFuture, int] | None = None,
             budget: int | None = None, share: int | None = None) -> tuple[list[ForwardFuture], list[ForwardFuture]]:
        """The copies that may run now and, if `fire`, the queued forwards that may join a batch after
        `ahead` (the running loops' steps, which go first): nothing they touch is touched by a job
        ahead of them, and the batch stays within `max_tokens` tokens. `dry`: leave the queue as is.

        `chunk` > 0: a forward of more new tokens runs in chunks (host/batching/chunks.py), and the
        chunks in one batch take at most `chunk` tokens together. A chunk that is not the forward's
        last joins the batch as a job of its own (`ForwardFuture.parent`); the forward stays queued
        in its place, so everything behind it waits as for any job ahead. Its last chunk is the
        forward itself (`chunks.part` is what runs). `chosen` (from `choose`): only these forwards
        may join, a chunked one with at most the tokens chosen for it (the share goes in the service
        levels' order, not the queue's).

        `budget` (`--prefill-chunk auto`, host/batching/stepcost.py): instead of a fixed chunk, every
        forward of more than `DECODE_TOKENS` new tokens (a prefill) is chunked as needed so that the
        prefills in this batch take at most `budget` tokens together, and each at most `share` (if
        given: the scheduler's budget is a share per prefill that could join, so that several
        owners' prefills are not lined up behind one share); shorter ones (decode steps) join
        whole. A forward with input embeddings runs whole either way."""
        copies: list[ForwardFuture] = []
        batch: list[ForwardFuture] = []
        rest: list[ForwardFuture] = []
        reads: set[int] = set()  # pages read / written by the jobs ahead, except copies run at once
        writes: set[int] = set()
        behind: set[str] = set()  # owners with a job ahead that stays queued
        owners = {f.owner for f in ahead}
        tokens = len(ahead)
        split = _split(chunk, budget)  # forwards of more new tokens than this are chunked (0: none)
        chunk_left = budget if budget is not None else chunk  # tokens the chunks taken so far leave to others
        each = share if share is not None and budget is not None else chunk_left  # one forward's most
        if self.jobs:  # the loops' pages count as ahead of every queued job
            for fut in ahead:
                r, w = footprint(fut.request, page_size)
                reads |= r
                writes |= w
        for fut in self.jobs:
            req = fut.request
            r, w = footprint(req, page_size)
            if isinstance(req, CopyRequest):
                busy = fut.owner in behind or fut.owner in owners or any(b.owner == fut.owner for b in batch)
                if not busy and not (r & writes or w & reads or w & writes):
                    copies.append(fut)  # runs before the batch: nothing ahead of it is affected
                    continue
            elif fire and fut.owner not in behind and (chosen is None or fut in chosen) and not (r & writes or w & reads):
                # no conflict with any job ahead (taken or staying queued): order of page access kept
                ch = fut.chunks
                # (a forward with input embeddings runs whole: its vectors' runs are not split)
                if split and req.embeds is None and (ch is not None or len(req.tokens) > split):
                    left = len(req.tokens) - (ch.done if ch is not None else 0)
                    n = min(left, chunk_left, each, max_tokens - tokens if batch or ahead else left,
                            left if chosen is None else chosen[fut])
                    if n > 0 and not (ch is not None and ch.running):
                        chunk_left -= n
                        tokens += n
                        if n == left:  # its last chunk (or, with a budget, all of it): the forward itself runs
                            if not dry and ch is not None:
                                ch.take(req, n, page_size)
                            batch.append(fut)
                            reads |= r
                            writes |= w
                            continue
                        batch.append(fut if dry else self._chunk(fut, n, page_size))
                elif tokens + len(req.tokens) <= max_tokens or not (batch or ahead):
                    batch.append(fut)
                    tokens += len(req.tokens)
                    reads |= r
                    writes |= w
                    continue
            behind.add(fut.owner)  # later jobs of this owner wait too (order)
            rest.append(fut)
            reads |= r
            writes |= w
        if not dry:
            self.jobs = rest
            self.copies -= len(copies)
        return copies, batch

    @staticmethod
    def _chunk(fut: ForwardFuture, n: int, page_size: int) -> ForwardFuture:
        """The next `n` tokens of `fut` (a forward that stays queued) as a job of their own."""
        req = fut.request
        assert isinstance(req, ForwardRequest)
        if fut.chunks is None:
            fut.chunks = Chunks(len(req.outputs))
        part = ForwardFuture(fut.chunks.take(req, n, page_size), fut.owner)
        part.parent = fut
        fut.chunks.running = True
        return part
