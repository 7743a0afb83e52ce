"""Memory pressure: suspend instances to host memory and resume them, instead of failing anyone.

When an allocation cannot be met (`kv.allocate`, `forward.generate-fresh`; a host-side loop that
finds no page for its next step ends with `out-of-pages` and its SDK asks `kv.allocate`), the
instance waits in line here and one `Suspender` thread per replica makes room:

- **Who is suspended.** The instance of the lowest priority (the highest number, host/levels.py),
  among equals the most recently started (first page taken), that holds pages only it holds, never the one whose allocation is being made room for (`_victim`). Pages shared
  with anyone (an export, an importer, another instance's prefix-cache hit) stay where they are.
- **How.** Its state becomes SUSPENDING under its `touch` lock (every page-touching import of its
  thread holds that lock from its check to the pins of the work it queues, so from then on its
  next forward or page call blocks, `Suspender.gate`); a host-side loop it runs ends at its next
  step with `out-of-pages` (the SDK then asks again and waits); once none of its own pages is
  pinned (its queued forwards have run, in order), their K/V is copied to host memory on the
  scheduler thread between batches (`SwapsPages.swap_out`) and the pages are freed. The guest's
  page ids stay valid: they map to SWAPPED, then to whatever pages it is resumed into
  (`InstancePages.phys`, host/state/page_table.py).
- **Order.** Waiting allocations of instances that hold pages come first (in arrival order: they
  are the running work), then resumes (in suspension order, each when its pages fit with a
  `watermark` to spare), then first allocations of new instances (never ahead of a suspended one:
  no starvation).
- **Bounds.** The swap space has its own budget (`HostConfig.swap_memory_bytes`); an instance
  whose pages do not fit in it is not chosen. An allocation that can never be met (the instance
  alone would need more than the whole cache, or its page limit) fails at once with
  `out_of_resources`; so does one nobody can make room for (nothing in flight, every other
  instance waiting or unswappable: e.g. a backend without `SwapsPages`, tensor-parallel engines).

Where to change the policy: `_victim` (who), `_step` (the order), `watermark` (resume headroom).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from itertools import count as counter
from typing import TYPE_CHECKING, Any

from gpu_backend.types import SwapsPages
from host.state.pages import ACTIVE, RESUMING, SUSPENDED, SUSPENDING, InstancePages, PageManager

if TYPE_CHECKING:
    from host.batching.scheduler import Scheduler
    from host.wasm.instance import Instance

__all__ = ["OutOfResources", "Suspender", "SuspendStats", "DEFAULT_SWAP_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_SWAP_BYTES = 4 * 2**30  # --swap-memory: host memory for suspended instances' KV


class OutOfResources(Exception):
    """An allocation that can never be met: the instance ends with `out_of_resources`."""


@dataclass
class SuspendStats:
    suspensions: int = 0
    resumes: int = 0
    swapped_pages: int = 0  # pages copied out, ever
    swapped_bytes: int = 0
    waits: int = 0  # allocations that waited in line
    out_of_resources: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(eq=False)
class _Request:
    inst: Instance
    count: int
    new: bool  # the instance held no page when it asked
    result: list[int] | str | OutOfResources | None = None


@dataclass
class _Known:
    inst: Instance
    seq: int  # start order: the most recent is suspended first


class _Gate:
    """`with suspender.gate(inst):` around a page-touching call: waits while the instance is
    suspended, then holds its `touch` lock (the suspender cannot start suspending it meanwhile)."""

    __slots__ = ("inst", "table", "lock")

    def __init__(self, inst: Instance) -> None:
        self.inst, self.table, self.lock = inst, inst.pages, inst.pages.touch

    def __enter__(self) -> None:
        table, lock = self.table, self.lock
        while True:
            lock.acquire()
            if table.state is ACTIVE:
                return
            lock.release()
            inst = self.inst
            inst.wait_until(lambda: table.state is ACTIVE)
            if inst.stepper is not None:  # its predictions were made on the pages it had before
                inst.stepper.drop()

    def __exit__(self, *exc: Any) -> None:
        self.lock.release()

    def try_enter(self) -> bool:
        """Enter only if that needs no wait: False while the instance is (being) suspended."""
        if not self.lock.acquire(blocking=False):
            return False
        if self.table.state is ACTIVE:
            return True
        self.lock.release()
        return False


@dataclass
class Suspender:
    """Makes room under KV pressure for one replica (its page manager, scheduler and backend)."""

    pages: PageManager
    scheduler: Scheduler
    backend: object
    swap_limit: int = DEFAULT_SWAP_BYTES
    watermark: int = 1  # a resume leaves this many pages free (the running instances' next page)
    stats: SuspendStats = field(default_factory=SuspendStats)

    def __post_init__(self) -> None:
        b = self.backend
        self.swapper: SwapsPages | None = b if isinstance(b, SwapsPages) and b.swap_page_bytes > 0 else None
        self._lock = self.pages._freed  # the page manager's: frees wake the thread while it has work
        # (with nothing to do it waits here instead, woken by a request or `stop`, not by every free:
        # a page manager frees pages several times per completion)
        self._idle = threading.Condition(self.pages._lock)
        self._requests: deque[_Request] = deque()
        self._suspended: deque[InstancePages] = deque()
        self._known: dict[str, _Known] = {}
        self._seq = counter()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pie-suspender", daemon=True)
        self._thread.start()

    # ---- instance threads ----
    def gate(self, inst: Instance) -> _Gate:
        """The context a page-touching import runs in (see `_Gate`)."""
        g = inst.pages.gate
        if isinstance(g, _Gate):
            return g
        g = inst.pages.gate = _Gate(inst)
        with self._lock:
            self._known[inst.pages.owner] = _Known(inst, next(self._seq))
        return g

    def allocate(self, inst: Instance, count: int) -> list[int] | str:
        """`count` pages for `inst` (guest ids), waiting in line for them when none are free; an
        error string for a refusal the guest can handle. Raises OutOfResources when they can never be had."""
        table, pm = inst.pages, self.pages
        with self.gate(inst):
            try:
                self._never_fits(table, count)
            except OutOfResources:
                with self._lock:
                    self.stats.out_of_resources += 1
                raise
            if self._straight(table):
                got = pm.allocate(table, count)
                if not isinstance(got, str) or not got.startswith("out of KV pages"):
                    return got
            req = _Request(inst, count, new=not table.held)
            with self._lock:
                self._requests.append(req)
                self.stats.waits += 1
                self._lock.notify_all()
                self._idle.notify_all()
        try:
            inst.wait_until(lambda: req.result is not None)
        finally:
            with self._lock:
                if req in self._requests:
                    self._requests.remove(req)
        if isinstance(req.result, OutOfResources):
            raise req.result
        assert req.result is not None
        return req.result

    def allocates_now(self, table: InstancePages, count: int) -> bool:
        """Whether `allocate` of `count` pages would go straight to the page manager (no wait in line,
        no end of the instance); the caller holds the instance's gate (for a caller that must not block:
        host/api/forward.py's `generate-fresh` begun on a worker's reader thread)."""
        try:
            self._never_fits(table, count)
        except OutOfResources:
            return False
        return self._straight(table)

    def _straight(self, table: InstancePages) -> bool:
        """No one waits in line before it (a new instance also waits behind a suspended one)."""
        return not self._requests and bool(table.held or not self._suspended)

    def _never_fits(self, table: InstancePages, count: int) -> None:
        pm = self.pages
        have = len(table.held)
        if count < 0:
            return  # (the page manager names the bad value)
        if have + count > pm.num_pages:
            raise OutOfResources(f"the instance needs {have + count} KV pages ({have} held, {count} more) and the "
                                 f"whole cache has {pm.num_pages}: it can never fit (raise --kv-memory)")
        cap = pm.max_pages_per_instance
        if cap is not None and table.owned_count + count > cap:
            raise OutOfResources(f"instance page limit: holds {table.owned_count}, asked {count} more, limit {cap} "
                                 "pages (--max-pages-per-instance)")

    def forget(self, inst: Instance) -> None:
        """The instance has ended (its pages and swap were released)."""
        with self._lock:
            self._known.pop(inst.pages.owner, None)
            self._lock.notify_all()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            self._lock.notify_all()
            self._idle.notify_all()
        self._thread.join(timeout=5)

    def as_dict(self) -> dict[str, int]:
        with self._lock:
            return {**self.stats.as_dict(), "suspended": len(self._suspended), "waiting": len(self._requests),
                    "swap_used_bytes": self.pages.swap_used, "swap_limit_bytes": self.swap_limit}

    # ---- the suspender thread ----
    def _loop(self) -> None:
        idle = False
        while True:
            with self._lock:
                if self._stopped:
                    return
                if not (self._requests or self._suspended):
                    self._idle.wait()
                elif idle:
                    self._lock.wait(0.2)
                if self._stopped:
                    return
            try:
                idle = not self._step()
            except Exception:  # a host bug: logged, the thread carries on (the waiters wait on)
                log.exception("suspender step failed")
                idle = True

    def _pending(self, new: bool) -> list[_Request]:
        with self._lock:
            return [r for r in self._requests if r.new == new and r.result is None and r.inst.pages.state is ACTIVE]

    def _step(self) -> bool:
        """One decision (see the module docstring for the order); whether anything changed."""
        for req in self._pending(new=False):
            if not self._grant(req):
                return self._make_room(req)
        while self._suspended:
            t = self._suspended[0]
            if t.ended:
                with self._lock:
                    self._suspended.popleft()
                continue
            if t.state is SUSPENDED and self.pages.free_count >= len(t.swapped) + self.watermark:
                return self._resume(t)
            return False  # new instances wait behind it
        granted = False
        for req in self._pending(new=True):
            if not self._grant(req):
                if self._stuck(req):
                    return True
                break
            granted = True
        return granted

    def _grant(self, req: _Request) -> bool:
        table = req.inst.pages
        with table.touch:
            if table.ended:  # (its thread has stopped waiting: nobody takes the answer)
                self._answer(req, "the instance has ended")
                return True
            if table.state is not ACTIVE:
                return False
            got = self.pages.allocate(table, req.count)
        if isinstance(got, str) and got.startswith("out of KV pages"):
            return False
        self._answer(req, got)
        return True

    def _answer(self, req: _Request, result: list[int] | str | OutOfResources) -> None:
        with self._lock:
            req.result = result
            if req in self._requests:
                self._requests.remove(req)
        req.inst.wake()

    def _make_room(self, req: _Request) -> bool:
        victim = self._victim(req.inst.pages)
        if victim is None:
            return self._stuck(req)
        return self._suspend(victim)

    def _victim(self, keep: InstancePages) -> InstancePages | None:
        """The instance of the lowest priority (the highest number: host/levels.py), the most recently
        started among equals, with pages of its own that fit in the swap space."""
        if self.swapper is None:
            return None
        with self._lock:
            known = sorted(self._known.values(), key=lambda k: (-k.inst.pages.priority, -k.seq))
        per_page = self.swapper.swap_page_bytes
        for k in known:
            t = k.inst.pages
            if t is keep or t.state is not ACTIVE or t.ended:
                continue
            _guests, phys = self.pages.own_pages(t)
            if phys and self.pages.swap_used + len(phys) * per_page <= self.swap_limit:
                return t
        return None

    def _stuck(self, req: _Request) -> bool:
        """Nobody can make room for `req` and nothing will come free by itself (no forward queued or
        running, every other instance holding pages waits too): it ends with out_of_resources."""
        if self.scheduler.busy():
            return False
        with self._lock:
            waiting = {r.inst.pages.owner for r in self._requests}
            others = [k for k in self._known.values() if k.inst.pages.owner not in waiting
                      and k.inst.pages.state is ACTIVE and k.inst.pages.held]
        if others:
            return False
        time.sleep(0.05)  # a forward may have just been submitted: look once more
        if self.scheduler.busy() or req.result is not None:
            return False
        if self._grant(req):  # an instance ended (and freed its pages) since the first try
            return True
        why = ("the backend cannot move KV pages to host memory (tensor parallel engines)" if self.swapper is None
               else f"the swap space ({self.pages.swap_used} of {self.swap_limit} bytes used) cannot take more")
        with self._lock:
            self.stats.out_of_resources += 1
        self._answer(req, OutOfResources(
            f"kv.allocate({req.count}): no KV page will come free ({self.pages.free_count} free of "
            f"{self.pages.num_pages}, the other instances wait for pages too) and {why}"))
        return True

    def _suspend(self, table: InstancePages) -> bool:
        """Suspend `table`'s instance: stop it touching its pages, let its queued work run, copy its
        own pages out and free them. False if it ended or had nothing to move after all."""
        assert self.swapper is not None
        with table.touch:
            if table.state is not ACTIVE or table.ended:
                return False
            table.state = SUSPENDING
        moved = False
        try:
            loop = table.loop
            if loop is not None:
                loop.cancel("out-of-pages")
            pm = self.pages
            _g, phys = pm.own_pages(table)
            pm.wait_unpinned(phys, lambda: table.ended)
            guests, phys = pm.own_pages(table)  # (a loop may have taken a page before it ended)
            pm.wait_unpinned(phys, lambda: table.ended)
            if table.ended or not phys:
                return False
            pm.pin(phys)
            swapper = self.swapper
            try:
                swap = self.scheduler.call(lambda: swapper.swap_out(phys))
            except BaseException:
                pm.unpin(phys)
                raise
            nbytes = len(phys) * swapper.swap_page_bytes
            moved = pm.evict(table, guests, phys, swap, nbytes)
            if moved:
                with self._lock:
                    table.state = SUSPENDED
                    self._suspended.append(table)
                    st = self.stats
                    st.suspensions += 1
                    st.swapped_pages += len(phys)
                    st.swapped_bytes += nbytes
                log.debug("suspended %s: %d pages (%d bytes) to host memory", table.owner, len(phys), nbytes)
            return moved
        finally:
            if not moved:
                self._wake(table)

    def _resume(self, table: InstancePages) -> bool:
        assert self.swapper is not None
        table.state = RESUMING
        pages = self.pages.restore_pages(table)
        if pages is None:
            table.state = SUSPENDED
            return False
        swap, swapper = table.swap, self.swapper
        try:
            self.scheduler.call(lambda: swapper.swap_in(swap, pages))
        finally:
            self.pages.settle(table, pages)
            with self._lock:
                self._suspended.remove(table)
                self.stats.resumes += 1
            self._wake(table)
        log.debug("resumed %s into %d pages", table.owner, len(pages))
        return True

    def _wake(self, table: InstancePages) -> None:
        with table.touch:
            table.state = ACTIVE
        with self._lock:
            known = self._known.get(table.owner)
        if known is not None:
            known.inst.wake()

