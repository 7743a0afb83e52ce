"""The page manager's side of suspension: an instance's own pages out to host memory and back.

host/suspend.py drives it: `own_pages` says what may move, `evict` frees the pages once their
K/V is copied out (their guest ids map to SWAPPED), `restore_pages` maps the ids to free pages
again (pinned) and `settle` unpins them once the K/V is back.
"""

from __future__ import annotations

from collections.abc import Callable

from host.state.page_book import PageBook
from host.state.page_table import SWAPPED, InstancePages

__all__ = ["PageSwap"]


class PageSwap(PageBook):
    """Suspension's page moves (part of `PageManager`, host/state/pages.py)."""

    def own_pages(self, table: InstancePages) -> tuple[list[int], list[int]]:
        """The guest ids and physical pages only `table` holds (no export, no other instance, not
        only a read-only prefix-cache hit shared with others): what a suspension may move."""
        with self._lock:
            guests, phys = [], []
            for g, entry in table.held.items():
                p = table.phys.get(g, g) if table.phys else g
                if p != SWAPPED and self._refs[p] == entry[0]:
                    guests.append(g)
                    phys.append(p)
            return guests, phys

    def wait_unpinned(self, pages: list[int], ready: Callable[[], bool]) -> None:
        """Block until none of `pages` is pinned (their jobs have run) or `ready()`."""
        with self._lock:
            self.watching += 1
            try:
                while any(self._pins[p] for p in pages) and not ready():
                    self._freed.wait(0.5)
            finally:
                self.watching -= 1

    def evict(self, table: InstancePages, guests: list[int], phys: list[int], swap: object, nbytes: int) -> bool:
        """The K/V of `phys` (pinned by the caller while it was copied out into `swap`) is in host
        memory: the pages go back (unpinned), their guest ids now map to SWAPPED. False (nothing
        changes but the unpin) if the instance ended or another holder took one of them meanwhile."""
        with self._lock:
            for p in phys:
                self._pins[p] -= 1
            if table.ended or any(self._refs[p] != table.held[g][0] for g, p in zip(guests, phys, strict=True)):
                for p in phys:
                    if self._pins[p] == 0 and self._refs[p] == 0:
                        self._let_go(p)
                return False
            table.swapped, table.swap_filled = guests, [self._filled[p] for p in phys]
            table.swap, table.swap_bytes = swap, nbytes
            self.swap_used += nbytes
            for g, p in zip(guests, phys, strict=True):
                table.phys[g] = SWAPPED
                table.guest.pop(p, None)
            table.moves += 1
            for p in phys:
                self._refs[p] = 0
                if self._pins[p] == 0:
                    self._let_go(p)
            table.drops += 1
            self._freed.notify_all()
            return True

    def restore_pages(self, table: InstancePages) -> list[int] | None:
        """Free pages for a suspended table's swapped pages (pinned until `settle`), its guest ids
        mapped to them; None if too few are free or the instance has ended."""
        with self._lock:
            n = len(table.swapped)
            if table.ended or self.free_count < n:
                return None
            pages = [self._take_free() for _ in range(n)]
            tenant = table.tenant
            for g, p, filled in zip(table.swapped, pages, table.swap_filled, strict=True):
                self._refs[p] = table.held[g][0]
                self._pins[p] += 1
                self._filled[p] = filled
                self._charged_to[p] = tenant
                if p == g:
                    del table.phys[g]
                else:
                    table.phys[g], table.guest[p] = p, g
            self._tenant_pages[tenant] = self._tenant_pages.get(tenant, 0) + n
            return pages

    def settle(self, table: InstancePages, pages: list[int]) -> None:
        """The swapped K/V is back in `pages`: unpin them, drop the host-memory copy."""
        with self._lock:
            self.swap_used -= table.swap_bytes
            table.swapped, table.swap_filled, table.swap, table.swap_bytes = [], [], None, 0
            table.drops += 1
            for p in pages:
                self._pins[p] -= 1
                if self._pins[p] == 0 and self._refs[p] == 0:  # the instance ended meanwhile
                    self._let_go(p)
            self._freed.notify_all()
