"""Sharing pages: exports under a tenant's names, imports (read-only holds) and their removal.

Export names belong to a tenant (the client identity that launched the exporter; "local" for
the embedded host and a server without tokens): an instance sees, imports and unexports only
its own tenant's exports, and a name in use within a tenant cannot be taken over. An export
holds one ref-count on each of its pages until it is removed (or its non-persistent owner ends).
"""

from __future__ import annotations

from host.state.page_book import Export, PageBook
from host.state.page_table import InstancePages, PageError

__all__ = ["PageExports"]


class PageExports(PageBook):
    """The page manager's exports (part of `PageManager`, host/state/pages.py)."""

    def export(self, table: InstancePages, name: str, pages: list[int], persistent: bool) -> str | None:
        """Share pages under `name`; returns an error string if the name is taken."""
        with self._lock:
            for p in pages:
                if p not in table.held:
                    raise PageError(f"page {p} is not held by this instance")
            key = (table.tenant, name)
            if key in self._exports:
                return f"export name {name!r} is already in use"
            phys = list(self.to_phys(table, pages))
            self._exports[key] = Export(phys, table.owner, persistent)
            for p in phys:
                self._refs[p] += 1
            return None

    def import_(self, table: InstancePages, name: str) -> list[int] | str:
        """Hold the pages exported under `name`, read-only; an error string if unknown."""
        with self._lock:
            exp = self._exports.get((table.tenant, name))
            if exp is None:
                return f"no export named {name!r}"
            return self._hold_read_only(table, exp.pages)

    def unexport(self, table: InstancePages, name: str) -> str | None:
        """Remove one of the table's tenant's exports; an error string if it has none by that name."""
        with self._lock:
            exp = self._exports.pop((table.tenant, name), None)
            if exp is None:
                return f"no export named {name!r}"
            for p in exp.pages:
                self._unref(p)
            self._freed.notify_all()
            return None

    def has_export(self, tenant: str, name: str) -> bool:
        with self._lock:
            return (tenant, name) in self._exports

    def drop_contents(self) -> int:
        """The engine holding these pages lost its KV cache (it died and was restarted): every export
        is removed and the prefix cache forgets every page (idle cached pages go back to the free
        list). Pages instances hold stay theirs until they release them. Returns the exports dropped."""
        with self._lock:
            exports = list(self._exports.values())
            self._exports.clear()
            for exp in exports:
                for p in exp.pages:
                    self._unref(p)
            if self.cache is not None:
                self._free.extend(self.cache.clear())
            self._freed.notify_all()
            return len(exports)

    def list_exports(self, table: InstancePages) -> list[tuple[str, int]]:
        """The table's tenant's exports: (name, page count)."""
        with self._lock:
            return [(n, len(e.pages)) for (t, n), e in self._exports.items() if t == table.tenant]
