"""The scheduler's queue: jobs waiting to run, and which of them may join the next batch.

Order: a job is never run together with, or ahead of, an earlier queued job of the same owner or
one whose pages it reads or writes; a KV copy runs between batches in that same order, before the
batch when nothing ahead of it touches its pages. Lock-free: the scheduler holds its lock around
every call.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from host.batching.future import CopyRequest, ForwardFuture, Job

__all__ = ["JobQueue", "job_pages", "footprint"]


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

    def take(self, fire: bool, ahead: Sequence[ForwardFuture], page_size: int, max_tokens: int,
             dry: bool = False) -> tuple[list[ForwardFuture], list[ForwardFuture]]:
        """The copies that may run now and, if `fire`, the queued forwards that may join a batch after
        `ahead` (the running loops' steps, which go first): nothing they touch is touched by a job
        ahead of them, and the batch stays within `max_tokens` tokens. `dry`: leave the queue as is."""
        copies: list[ForwardFuture] = []
        batch: list[ForwardFuture] = []
        rest: list[ForwardFuture] = []
        reads: set[int] = set()  # pages read / written by the jobs ahead, except copies run at once
        writes: set[int] = set()
        behind: set[str] = set()  # owners with a job ahead that stays queued
        owners = {f.owner for f in ahead}
        tokens = len(ahead)
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
            elif fire and fut.owner not in behind and not (r & writes or w & reads):
                # no conflict with any job ahead (taken or staying queued): order of page access kept
                if tokens + len(req.tokens) <= max_tokens or not (batch or ahead):
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
