"""The page book: the host-wide free list, ref-counts, pins and the guest-id mapping, and the
primitives on them that the page manager's parts share (host/state/pages.py, exports.py, swap.py).

Invariants (checked by tests): a page is on the free list iff its ref-count is 0 and no job
pins it; the ref-count of a page = holds by instances + 1 per export name that lists it; a page
is pinned while a forward or copy that reads or writes it is queued or running. Everything the
book stores in its arrays, exports and the prefix cache is physical; what it hands a guest is
the guest's id (host/state/page_table.py). Methods whose name starts with `_` run with the lock held.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from host.state.page_table import SWAPPED, InstancePages, PageError
from host.state.prefix_cache import PrefixCache

__all__ = ["Export", "PageBook"]


@dataclass
class Export:
    """Pages shared under a name by an instance of a tenant (host/state/exports.py)."""

    pages: list[int]
    owner: str
    persistent: bool


class PageBook:
    """The page manager's state and the primitives on it; thread-safe under `_lock`."""

    def __init__(self, num_pages: int, max_pages_per_instance: int | None = None,
                 cache: PrefixCache | None = None, max_pages_per_tenant: int | None = None) -> None:
        self.num_pages = num_pages
        self.cache = cache  # the automatic prefix cache (None: pages are freed as soon as nobody holds them)
        self.max_pages_per_instance = max_pages_per_instance
        self.max_pages_per_tenant = max_pages_per_tenant
        # The tenant whose instance allocated each page, until the page is let go (free or only
        # in the prefix cache): held, exported (persistent or not) or pinned, it counts against
        # that tenant's cap, so a tenant cannot hoard pages past it through exports.
        self._charged_to: list[str | None] = [None] * num_pages
        self._tenant_pages: dict[str, int] = {}
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._pins = [0] * num_pages  # queued or running jobs touching each page
        self._filled = [0] * num_pages  # slots written since the page was allocated (a high-water mark)
        self._exports: dict[tuple[str, str], Export] = {}  # (tenant, name) -> export
        self.refused = 0  # allocations refused for lack of free pages (a condition the guest waits out)
        self.swap_used = 0  # bytes of host memory held by suspended instances' pages (host/suspend.py)
        self.watching = 0  # threads waiting for pins to drop (host/suspend.py): unpin notifies them
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)

    @property
    def free_count(self) -> int:
        """Pages an allocation can have: the free list and the cached pages nobody holds."""
        return len(self._free) + (self.cache.idle if self.cache is not None else 0)

    def _new_ids(self, table: InstancePages, pages: list[int]) -> list[int]:
        """The guest ids of physical pages `table` starts to hold (lock held): the page's own id
        unless the table uses it already for another page (after a resume), then a synthetic one."""
        if not table.phys:
            return pages
        ids = []
        for p in pages:
            g = p
            if p in table.held:
                g = table.next_id = max(table.next_id, self.num_pages) + 1
                table.phys[g], table.guest[p] = p, g
            ids.append(g)
        return ids

    def _held_as(self, table: InstancePages, page: int) -> int | None:
        """The guest id under which `table` holds physical `page`, or None (lock held)."""
        g = table.guest.get(page) if table.guest else None
        if g is not None:
            return g
        return page if page in table.held and page not in table.phys else None

    def to_phys(self, table: InstancePages, pages: list[int]) -> list[int]:
        """The physical pages of guest ids `table` holds (the list itself when none is mapped)."""
        phys = table.phys
        if not phys:
            return pages
        out = [phys.get(g, g) for g in pages]
        if SWAPPED in out:
            raise PageError(f"instance {table.owner} touched a page while its KV is swapped out")
        return out

    def to_guest(self, table: InstancePages, pages: list[int]) -> list[int]:
        """The guest ids of physical pages `table` holds."""
        back = table.guest
        return [back.get(p, p) for p in pages] if back else pages

    def _take_free(self) -> int:
        if self._free:
            return self._free.pop()
        assert self.cache is not None  # free_count counted the cache's idle pages
        page = self.cache.evict()
        assert page is not None
        return page

    def _unref(self, page: int) -> None:
        self._refs[page] -= 1
        if self._refs[page] == 0 and self._pins[page] == 0:
            self._let_go(page)

    def _let_go(self, page: int) -> None:
        """Nobody holds or pins `page`: the prefix cache keeps it, or it is free."""
        tenant = self._charged_to[page]
        if tenant is not None:
            self._charged_to[page] = None
            self._tenant_pages[tenant] -= 1
        if self.cache is None or not self.cache.keep(page):
            self._free.append(page)

    def _hold_read_only(self, table: InstancePages, pages: list[int]) -> list[int]:
        """One more read-only hold by `table` on each page (imports, prefix-cache hits); lock held.
        Returns the pages' guest ids."""
        ids = []
        for p in pages:
            g = self._held_as(table, p)
            if g is None:
                g = self._new_ids(table, [p])[0]
                table.held[g] = [1, False]
            else:
                table.held[g][0] += 1
            self._refs[p] += 1
            ids.append(g)
        return ids

    def refcount(self, page: int) -> int:
        return self._refs[page]
