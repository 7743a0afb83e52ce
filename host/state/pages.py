"""KV page ownership: the host-wide free list, ref-counts, per-instance holdings and exports.

Export names belong to a tenant (the client identity that launched the exporter; "local" for
the embedded host and a server without tokens): an instance sees, imports and unexports only
its own tenant's exports, and a name in use within a tenant cannot be taken over.

Invariants (checked by tests): a page is on the free list iff its ref-count is 0 and no job
pins it; the ref-count of a page = holds by instances + 1 per export name that lists it; a page
is pinned while a forward or copy that reads or writes it is queued or running (the scheduler
pins at submit and unpins when the job ends), so a page an instance releases with a write still
queued cannot be handed to another instance before that write has landed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from host.state.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from gpu_backend.types import ForwardRequest


class PageError(Exception):
    """Guest misuse of page ids (a bug: the caller traps the instance)."""


@dataclass
class InstancePages:
    """The pages one instance holds: page -> [hold count, writable]."""

    owner: str
    tenant: str = "local"  # whose export names this instance sees (set by the host at launch)
    held: dict[int, list] = field(default_factory=dict)
    owned_count: int = 0  # pages this instance allocated and still holds (for its cap)
    replica: int = 0  # the engine replica the instance lives on (host/replicas.py); its pages are that one's
    drops: int = 0  # pages this instance stopped holding, ever: a page list checked before may be stale
    # the page list of its last per-token pass, found held and free of repeats while `drops` was
    # `checked_drops` (PageManager.check_step_pages)
    checked: list[int] = field(default_factory=list)
    checked_set: set[int] = field(default_factory=set)
    checked_drops: int = -1


@dataclass
class _Export:
    pages: list[int]
    owner: str
    persistent: bool


class PageManager:
    """Thread-safe page allocator shared by all instances of a host."""

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
        self._exports: dict[tuple[str, str], _Export] = {}  # (tenant, name) -> export
        self.refused = 0  # allocations refused for lack of free pages (a condition the guest waits out)
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)

    @property
    def free_count(self) -> int:
        """Pages an allocation can have: the free list and the cached pages nobody holds."""
        return len(self._free) + (self.cache.idle if self.cache is not None else 0)

    def allocate(self, table: InstancePages, count: int) -> list[int] | str:
        """Allocate `count` pages for `table`; a string explains why not (a condition, not a bug)."""
        with self._lock:
            if count > self.num_pages:
                return f"requested {count} KV pages but the host has only {self.num_pages} in total"
            cap = self.max_pages_per_instance
            if cap is not None and table.owned_count + count > cap:
                return (f"instance page limit: holds {table.owned_count}, asked {count} more, "
                        f"limit {cap} pages")
            held = self._tenant_pages.get(table.tenant, 0)
            tcap = self.max_pages_per_tenant
            if tcap is not None and held + count > tcap:
                return (f"tenant page limit: the instances of tenant {table.tenant!r} hold {held}, asked {count} "
                        f"more, limit {tcap} pages (--max-pages-per-tenant)")
            free = self.free_count
            if count > free:
                self.refused += 1
                return f"out of KV pages: requested {count}, {free} free"
            pages = [self._take_free() for _ in range(count)]
            for p in pages:
                self._refs[p] = 1
                self._filled[p] = 0
                self._charged_to[p] = table.tenant
                table.held[p] = [1, True]
            table.owned_count += count
            self._tenant_pages[table.tenant] = held + count
            return pages

    def release(self, table: InstancePages, pages: list[int]) -> None:
        """Drop one hold on each page; raises PageError naming the first page not held."""
        with self._lock:
            counts: dict[int, int] = {}
            for p in pages:
                counts[p] = counts.get(p, 0) + 1
            for p, n in counts.items():
                entry = table.held.get(p)
                if entry is None or entry[0] < n:
                    raise PageError(f"page {p} is not held by this instance (foreign id or double release)")
            for p in pages:
                self._drop_hold(table, p)
            self._freed.notify_all()

    def _drop_hold(self, table: InstancePages, page: int) -> None:
        entry = table.held[page]
        entry[0] -= 1
        if entry[0] == 0:
            del table.held[page]
            table.drops += 1
            if entry[1]:
                table.owned_count -= 1
        self._unref(page)

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

    def pin(self, pages: Iterable[int]) -> None:
        """A job that reads or writes `pages` was queued: none of them may become free until `unpin`."""
        with self._lock:
            pins = self._pins
            for p in pages:
                pins[p] += 1

    def unpin(self, pages: Iterable[int]) -> None:
        """The job has ended: pages nobody refers to any more go back to the free list now."""
        with self._lock:
            pins, refs = self._pins, self._refs
            freed = False
            for p in pages:
                pins[p] -= 1
                if pins[p] == 0 and refs[p] == 0:
                    self._let_go(p)
                    freed = True
            if freed:
                self._freed.notify_all()

    def pinned(self, page: int) -> int:
        return self._pins[page]

    def check_pages(self, table: InstancePages, pages: list[int], writable_from: int) -> None:
        """Raise PageError unless all pages are held and pages[writable_from:] are writable."""
        held = table.held
        for i, p in enumerate(pages):
            entry = held.get(p)
            if entry is None:
                raise PageError(f"page {p} is not held by this instance")
            if i >= writable_from and not entry[1]:
                raise PageError(f"page {p} is read-only here (imported); new tokens cannot be written into it")

    def check_step_pages(self, table: InstancePages, pages: list[int], writable_from: int) -> None:
        """`check_pages`, and no page repeated, for a pass sent every token with the
        whole page list: O(pages added) when `pages` extends the list this table last passed here
        and the instance has dropped no page since (instead of a dict lookup per page per token:
        a 4k-token context is 256 pages)."""
        ok = table.checked
        n = len(ok)
        if n and table.checked_drops == table.drops and len(pages) >= n and pages[n - 1] == ok[-1] \
                and pages[:n] == ok:
            seen, new = table.checked_set, pages[n:]
        else:
            seen, new = set(), pages
        held = table.held
        table.checked = []  # stays empty if a check below fails (seen may be half-updated)
        for p in new:
            if p in seen:
                raise PageError(f"the page list repeats a page: {pages}")
            if p not in held:
                raise PageError(f"page {p} is not held by this instance")
            seen.add(p)
        self.check_pages(table, pages[writable_from:], 0)  # the written ones writable (all held: checked)
        table.checked, table.checked_set, table.checked_drops = list(pages), seen, table.drops

    def check_writable(self, table: InstancePages, page: int) -> None:
        entry = table.held.get(page)
        if entry is None:
            raise PageError(f"page {page} is not held by this instance")
        if not entry[1]:
            raise PageError(f"page {page} is read-only here (imported)")

    def export(self, table: InstancePages, name: str, pages: list[int], persistent: bool) -> str | None:
        """Share pages under `name`; returns an error string if the name is taken."""
        with self._lock:
            for p in pages:
                if p not in table.held:
                    raise PageError(f"page {p} is not held by this instance")
            key = (table.tenant, name)
            if key in self._exports:
                return f"export name {name!r} is already in use"
            self._exports[key] = _Export(list(pages), table.owner, persistent)
            for p in pages:
                self._refs[p] += 1
            return None

    def import_(self, table: InstancePages, name: str) -> list[int] | str:
        """Hold the pages exported under `name`, read-only; an error string if unknown."""
        with self._lock:
            exp = self._exports.get((table.tenant, name))
            if exp is None:
                return f"no export named {name!r}"
            self._hold_read_only(table, exp.pages)
            return list(exp.pages)

    def _hold_read_only(self, table: InstancePages, pages: list[int]) -> None:
        """One more read-only hold by `table` on each page (imports, prefix-cache hits); lock held."""
        for p in pages:
            entry = table.held.get(p)
            if entry is None:
                table.held[p] = [1, False]
            else:
                entry[0] += 1
            self._refs[p] += 1

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

    def release_all(self, table: InstancePages) -> None:
        """Drop every hold of an ending instance and its non-persistent exports."""
        with self._lock:
            for key in [k for k, e in self._exports.items() if e.owner == table.owner and not e.persistent]:
                for p in self._exports.pop(key).pages:
                    self._unref(p)
            for p, entry in list(table.held.items()):
                for _ in range(entry[0]):
                    self._unref(p)
            table.held.clear()
            table.drops += 1
            table.owned_count = 0
            self._freed.notify_all()

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def tenant_pages(self, tenant: str) -> int:
        """Pages allocated by `tenant`'s instances and not let go yet (what its cap counts)."""
        with self._lock:
            return self._tenant_pages.get(tenant, 0)

    # ---- the prefix cache ----
    def attach_prefix(self, table: InstancePages, tokens: Sequence[int]) -> list[int]:
        """Hold, read-only, the cached pages of the longest full-page prefix of `tokens` (a sequence
        from position 0); [] without a cache or a hit. They count against no instance's quota."""
        if self.cache is None:
            return []
        with self._lock:
            pages = self.cache.lookup(tokens, table.tenant)
            self._hold_read_only(table, pages)
            return pages

    def note_write(self, table: InstancePages, req: ForwardRequest, page_size: int,
                   context_len: int | None = None) -> None:
        """A checked pass of `table`'s instance is being queued: a frozen page (shared through the
        prefix cache) must not be written; the cache learns what the written pages hold.
        `context_len`: the request's, when the caller has it at hand."""
        ctx = req.context_len(page_size) if context_len is None else context_len
        self._note(table, req.pages, page_size, ctx, req.tokens, req.positions, req.mask is not None)

    def note_run(self, table: InstancePages, pages: Sequence[int], page_size: int, ctx: int,
                 tokens: Sequence[int], first_position: int) -> None:
        """`note_write` for a run of causal one-token steps written after `ctx` at consecutive
        positions from `first_position` (a host-side generation loop notes its steps a page at a
        time: the same result as one note per step, for a fraction of the per-token cost)."""
        positions = range(first_position, first_position + len(tokens))
        self._note(table, pages, page_size, ctx, tokens, positions, False)

    def _note(self, table: InstancePages, pages: Sequence[int], page_size: int, ctx: int,
              tokens: Sequence[int], positions: Sequence[int], masked: bool) -> None:
        filled = self._filled  # the owner is the only writer of these pages: no lock needed
        if len(tokens) == 1:  # a decode step (every token of a stepping guest: kept short)
            j, slot = divmod(ctx, page_size)
            if filled[pages[j]] <= slot:
                filled[pages[j]] = slot + 1
        else:
            end = ctx + len(tokens)
            for j in range(ctx // page_size, (end - 1) // page_size + 1):
                p = pages[j]
                if filled[p] < end - j * page_size:
                    filled[p] = min(end - j * page_size, page_size)
        cache = self.cache
        if cache is None:
            return
        with self._lock:
            if cache.frozen:
                for p in pages[ctx // page_size:]:
                    if p in cache.frozen:
                        raise PageError(f"page {p} is shared through the prefix cache: it cannot be written again")
            cache.note_write(pages, ctx, tokens, positions, masked, table.tenant)

    def note_copy(self, table: InstancePages, dst_page: int, end: int) -> None:
        """A copy-tokens into `dst_page` up to slot `end` is being queued: refused into a frozen page;
        content unknown after."""
        self._filled[dst_page] = max(self._filled[dst_page], end)
        cache = self.cache
        if cache is None:
            return
        with self._lock:
            if dst_page in cache.frozen:
                raise PageError(f"page {dst_page} is shared through the prefix cache: it cannot be written again")
            cache.forget([dst_page])

    def filled(self, table: InstancePages, page: int) -> int:
        """How many slots of `page` (held by `table`'s instance) have been written since it was allocated.
        A host-side generation loop's writes count from when it notes them: a page at a time and at
        its end (`Generation.note_writes`), all before its owner runs again."""
        return self._filled[page]

    def forget_content(self, pages: Sequence[int]) -> None:
        """What these pages hold is no longer known (a failed pass, a copy into them)."""
        if self.cache is not None:
            with self._lock:
                self.cache.forget(pages)
