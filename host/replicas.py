"""Data parallel (`--replicas N`): N engines, each with its own KV cache, page manager and scheduler.

An instance lives on one replica, chosen at launch by load (`Host._place`); `InstancePages.replica`
says which. The WIT imports see one page manager and one scheduler: `ReplicaPages` and
`ReplicaSchedulers` route each call to the instance's replica, so page ids are that replica's own
(0..num_pages-1 on every replica) and a batch only ever holds one replica's requests. An export
lives on its exporter's replica: importing it from another replica is a clear error (KV pages do
not move between engines), and a name is unique across replicas.
Composed from the unchanged `PageManager` and `Scheduler`: nothing here runs on the hot path
beyond a dict lookup per call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from host.batching.scheduler import Scheduler, SchedulerStats
from host.state.pages import InstancePages, PageManager

if TYPE_CHECKING:
    from gpu_backend.types import ForwardRequest
    from host.batching.future import ForwardFuture, Job
    from host.batching.generation import Generation

__all__ = ["ReplicaPages", "ReplicaSchedulers"]


class ReplicaPages:
    """The page managers of all replicas behind `PageManager`'s interface (per instance table)."""

    def __init__(self, managers: list[PageManager]) -> None:
        self.replicas = managers
        self.num_pages = sum(m.num_pages for m in managers)
        self.cache = None  # per replica: `replicas[r].cache`
        self._names = threading.Lock()  # export names are unique across replicas

    def _of(self, table: InstancePages) -> PageManager:
        return self.replicas[table.replica]

    def manager(self, table: InstancePages) -> PageManager:
        """The page manager of the instance's replica (what a host-side generation loop works on:
        pins and runs of writes have no table to route by)."""
        return self.replicas[table.replica]

    @property
    def free_count(self) -> int:
        return sum(m.free_count for m in self.replicas)

    @property
    def refused(self) -> int:
        return sum(m.refused for m in self.replicas)

    def allocate(self, table: InstancePages, count: int) -> list[int] | str:
        return self._of(table).allocate(table, count)

    def release(self, table: InstancePages, pages: list[int]) -> None:
        self._of(table).release(table, pages)

    def release_all(self, table: InstancePages) -> None:
        self._of(table).release_all(table)

    def check_pages(self, table: InstancePages, pages: list[int], writable_from: int) -> None:
        self._of(table).check_pages(table, pages, writable_from)

    def check_step_pages(self, table: InstancePages, pages: list[int], writable_from: int) -> None:
        self._of(table).check_step_pages(table, pages, writable_from)

    def check_writable(self, table: InstancePages, page: int) -> None:
        self._of(table).check_writable(table, page)

    def export(self, table: InstancePages, name: str, pages: list[int], persistent: bool) -> str | None:
        with self._names:
            for r, m in enumerate(self.replicas):
                if r != table.replica and m.has_export(table.tenant, name):
                    return f"export name {name!r} is already in use (on engine replica {r})"
            return self._of(table).export(table, name, pages, persistent)

    def import_(self, table: InstancePages, name: str) -> list[int] | str:
        got = self._of(table).import_(table, name)
        if isinstance(got, str):
            for r, m in enumerate(self.replicas):
                if r != table.replica and m.has_export(table.tenant, name):
                    return (f"export {name!r} lives on engine replica {r} and this instance runs on replica "
                            f"{table.replica}: KV pages cannot be imported across replicas")
        return got

    def unexport(self, table: InstancePages, name: str) -> str | None:
        err = self._of(table).unexport(table, name)
        if err is not None:
            for r, m in enumerate(self.replicas):
                if r != table.replica and m.has_export(table.tenant, name):
                    return (f"export {name!r} lives on engine replica {r} and this instance runs on replica "
                            f"{table.replica}: it can only be removed from there")
        return err

    def list_exports(self, table: InstancePages) -> list[tuple[str, int]]:
        """The tenant's exports on the instance's own replica (the ones it can import)."""
        return self._of(table).list_exports(table)

    def attach_prefix(self, table: InstancePages, tokens: Sequence[int]) -> list[int]:
        return self._of(table).attach_prefix(table, tokens)

    def note_write(self, table: InstancePages, req: ForwardRequest, page_size: int,
                   context_len: int | None = None) -> None:
        self._of(table).note_write(table, req, page_size, context_len)

    def note_copy(self, table: InstancePages, dst_page: int, end: int) -> None:
        self._of(table).note_copy(table, dst_page, end)

    def filled(self, table: InstancePages, page: int) -> int:
        return self._of(table).filled(table, page)


class ReplicaSchedulers:
    """One `Scheduler` per replica behind `Scheduler`'s interface: jobs go to their owner's replica."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.replicas = schedulers
        self._owner: dict[str, int] = {}

    def place(self, owner: str, replica: int) -> None:
        self._owner[owner] = replica

    def drop(self, owner: str) -> None:
        self._owner.pop(owner, None)

    def _of(self, owner: str) -> Scheduler:
        return self.replicas[self._owner.get(owner, 0)]

    def submit(self, request: Job, owner: str, generation: Generation | None = None,
               lookahead: bool = False) -> ForwardFuture:
        return self._of(owner).submit(request, owner, generation, lookahead)

    def expect(self, owner: str) -> None:
        self._of(owner).expect(owner)

    def withdraw(self, fut: ForwardFuture) -> bool:
        return self._of(fut.owner).withdraw(fut)

    def forget(self, owner: str) -> None:
        r = self._owner.get(owner)
        for i, s in enumerate(self.replicas):
            if r is None or r == i:
                s.forget(owner)

    def call(self, fn: Callable[[], Any]) -> Any:
        return self.replicas[0].call(fn)

    @property
    def stats(self) -> SchedulerStats:
        """The replicas' counters added up (max_batch_size: the largest)."""
        total = SchedulerStats()
        for s in self.replicas:
            st = s.stats
            for f in ("batches", "forwards", "tokens", "copies", "queue_wait_s", "backend_s", "errors", "lookaheads",
                      "lookaheads_withdrawn"):
                setattr(total, f, getattr(total, f) + getattr(st, f))
            total.max_batch_size = max(total.max_batch_size, st.max_batch_size)
        return total

    def stop(self) -> None:
        for s in self.replicas:
            s.stop()
