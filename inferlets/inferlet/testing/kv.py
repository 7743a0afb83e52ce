"""Fake of the WIT interface `kv`: page holds, exports and imports, like the real page manager.

The pages' contents live in the backend (`TinyBackend.slots`); this side keeps who holds what.
"""

from __future__ import annotations

from collections.abc import Callable

from inferlet import _host
from inferlet.testing.records import trap
from inferlet.testing.tiny import Slot, TinyBackend

__all__ = ["FakeKv"]


class FakeKv:
    def __init__(self, backend: TinyBackend, max_pages: int | None) -> None:
        self.backend, self.max_pages = backend, max_pages
        self.ps, self.num_pages = backend.info.page_size, backend.info.num_pages
        self.free = list(range(self.num_pages - 1, -1, -1))
        self.holds: dict[int, list[int | bool]] = {}  # page -> [hold count, writable]
        self.exports: dict[str, list[int]] = {}
        self.export_refs: dict[int, int] = {}
        self.allocations = 0
        # called once, at the next allocation refused for lack of free pages (e.g. to free some)
        self.on_refused: Callable[[], None] | None = None
        self.prefix_lookups: list[list[int]] = []  # token lists passed to attach_prefix

    @property
    def slots(self) -> dict[int, list[Slot | None]]:
        """page -> the (token, position) in each slot, None where nothing was written."""
        return self.backend.slots

    @property
    def held(self) -> set[int]:
        return set(self.holds)

    @property
    def owned(self) -> set[int]:
        return {p for p, (_, w) in self.holds.items() if w}

    @property
    def imported(self) -> set[int]:
        return {p for p, (_, w) in self.holds.items() if not w}

    def page_size(self) -> int:
        return self.ps

    def free_pages(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if self.max_pages is not None and len(self.owned) + count > self.max_pages:
            raise _host.Err(f"instance page limit {self.max_pages} reached")
        if count > self.num_pages:
            raise _host.Err(f"requested {count} KV pages but the host has only {self.num_pages} in total")
        if count > len(self.free):
            hook, self.on_refused = self.on_refused, None
            if hook is not None:
                hook()
            raise _host.Err(f"out of KV pages: {count} asked, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(count)]
        for p in pages:
            self.holds[p] = [1, True]
        self.backend.erase(pages)
        self.allocations += 1
        return pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self.holds:
                raise trap("kv.release", f"page {p} is not held by this instance")
            self.holds[p][0] -= 1
            if self.holds[p][0] == 0:
                del self.holds[p]
            self._maybe_free(p)

    def _maybe_free(self, p: int) -> None:
        if p not in self.holds and self.export_refs.get(p, 0) == 0:
            self.free.append(p)

    def export_pages(self, name: str, pages: list[int], persistent: bool) -> None:
        if name in self.exports:
            raise _host.Err(f"export name {name!r} is taken")
        for p in pages:
            if p not in self.held:
                raise trap("kv.export-pages", f"page {p} is not held by this instance")
            self.export_refs[p] = self.export_refs.get(p, 0) + 1
        self.exports[name] = list(pages)

    def import_pages(self, name: str) -> list[int]:
        if name not in self.exports:
            raise _host.Err(f"no export named {name!r}")
        for p in self.exports[name]:
            self.holds.setdefault(p, [0, False])[0] += 1
        return list(self.exports[name])

    def unexport(self, name: str) -> None:
        if name not in self.exports:
            raise _host.Err(f"no export named {name!r}")
        for p in self.exports.pop(name):
            self.export_refs[p] -= 1
            self._maybe_free(p)

    def list_exports(self) -> list[tuple[str, int]]:
        return [(n, len(p)) for n, p in self.exports.items()]

    def attach_prefix(self, tokens: list[int]) -> list[int]:
        """The fake host has no prefix cache: nothing is ever attached (the lookups are counted)."""
        self.prefix_lookups.append(list(tokens))
        return []

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        if src_page not in self.held:
            raise trap("kv.copy-tokens", f"source page {src_page} is not held")
        if dst_page not in self.owned:
            raise trap("kv.copy-tokens", f"destination page {dst_page} is not owned")
        if src_offset + count > self.ps or dst_offset + count > self.ps:
            raise trap("kv.copy-tokens", f"{count} slots do not fit at offsets {src_offset}/{dst_offset}")
        self.backend.copy_tokens(src_page, src_offset, dst_page, dst_offset, count)
