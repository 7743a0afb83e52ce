"""Replicas (`--replicas N`): N engines, each with its own KV cache, page manager and scheduler.

An instance is placed on one replica at launch, by load (`Host._place`), and stays there:
`InstancePages.replica` is its index into `ApiServices.replicas`, and every WIT import it makes
reaches that `Replica`'s page manager and scheduler directly. Page ids are a replica's own
(0..num_pages-1 on every replica) and a batch only ever holds one replica's requests. Export names
are unique per tenant across replicas (`ExportNames`); an export lives on its exporter's replica,
and importing it from another replica is a clear error (KV pages do not move between engines).
With one replica (the default) this is the whole host's pages and scheduler.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from host.batching.scheduler import Scheduler
from host.batching.stats import SchedulerStats
from host.state.pages import InstancePages, PageManager
from host.suspend import Suspender

if TYPE_CHECKING:
    from host.wasm.instance import Instance

__all__ = ["ExportNames", "Replica", "total_stats"]

log = logging.getLogger(__name__)

_NO_GATE = nullcontext()


@dataclass(frozen=True)
class Replica:
    """One engine's share of the host: its KV pages and the scheduler that feeds its backend."""

    index: int
    pages: PageManager
    scheduler: Scheduler
    suspender: Suspender | None = None  # makes room under KV pressure (host/suspend.py); None: allocations fail

    def gate(self, inst: Instance) -> AbstractContextManager[Any]:
        """The context of a call that checks an instance's pages and queues work on them: it waits
        while the instance is suspended (`Suspender.gate`)."""
        return _NO_GATE if self.suspender is None else self.suspender.gate(inst)

    def gate_now(self, inst: Instance) -> AbstractContextManager[Any] | None:
        """`gate(inst)`, entered, if that needs no wait; None while the instance is (being) suspended.
        For a caller that must not block (host/workers/pool.py serves a decode step on its reader)."""
        if self.suspender is None:
            return _NO_GATE
        g = self.suspender.gate(inst)
        return g if g.try_enter() else None

    def release(self, inst: Instance) -> None:
        """An ended instance gives back what it holds here: its forwards are waited for, then its
        pages (and their host memory, if suspended) and its place in the scheduler."""
        # A forward still queued or running finishes on its own (its pages stay pinned until it
        # has, so the backend never writes into a page someone else owns); waiting for the guest's
        # own forwards here means its pages are all free by the time its end is reported. Not for a
        # decode-step run ahead that the guest never claimed (host/api/lookahead.py): a guest that
        # stops stepping (its max_tokens reached) would report its end one step late, every time;
        # that step's pages stay pinned and come free when it ends (`PageManager.unpin`).
        if inst.stepper is not None:
            inst.stepper.close()  # (withdrawn if still queued)
        for fut in inst.forwards.values():
            if not fut.done():
                try:
                    fut.wait()
                except Exception as e:  # only its end matters here; the error was the instance's to see
                    log.debug("instance %s ends with a failed forward: %s", inst.id, e)
        inst.forwards.clear()
        self.pages.release_all(inst.pages)  # (and its swapped-out pages' host memory, if suspended)
        if self.suspender is not None:
            self.suspender.forget(inst)
        self.scheduler.forget(inst.id)
        self.scheduler.drop_class(inst.id)


class ExportNames:
    """Export names, unique per tenant across replicas: the one place that looks past an instance's
    own replica (on one replica it only forwards to its page manager)."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        self._replicas = replicas
        self._lock = threading.Lock()

    def export(self, table: InstancePages, name: str, pages: list[int], persistent: bool) -> str | None:
        with self._lock:  # checked and taken together: two replicas cannot take one name at once
            where = self._elsewhere(table, name)
            if where is not None:
                return f"export name {name!r} is already in use (on engine replica {where})"
            return self._replicas[table.replica].pages.export(table, name, pages, persistent)

    def import_(self, table: InstancePages, name: str) -> list[int] | str:
        got = self._replicas[table.replica].pages.import_(table, name)
        if isinstance(got, str):
            where = self._elsewhere(table, name)
            if where is not None:
                return (f"export {name!r} lives on engine replica {where} and this instance runs on replica "
                        f"{table.replica}: KV pages cannot be imported across replicas")
        return got

    def unexport(self, table: InstancePages, name: str) -> str | None:
        err = self._replicas[table.replica].pages.unexport(table, name)
        if err is not None:
            where = self._elsewhere(table, name)
            if where is not None:
                return (f"export {name!r} lives on engine replica {where} and this instance runs on replica "
                        f"{table.replica}: it can only be removed from there")
        return err

    def _elsewhere(self, table: InstancePages, name: str) -> int | None:
        for r in self._replicas:
            if r.index != table.replica and r.pages.has_export(table.tenant, name):
                return r.index
        return None


def total_stats(replicas: Sequence[Replica]) -> SchedulerStats:
    """The replicas' scheduler counters added up (max_batch_size: the largest; the histogram summed)."""
    if len(replicas) == 1:
        return replicas[0].scheduler.stats
    total = SchedulerStats()
    for r in replicas:
        st = r.scheduler.stats
        for f in fields(SchedulerStats):
            a, b = getattr(total, f.name), getattr(st, f.name)
            if f.name in ("max_batch_size", "prefill_budget", "step_fixed_ms", "step_token_us"):
                setattr(total, f.name, max(a, b))  # (per replica: the largest)
            elif isinstance(a, list):
                setattr(total, f.name, [x + y for x, y in zip(a, b, strict=True)])
            else:
                setattr(total, f.name, a + b)
    return total
