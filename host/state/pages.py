"""KV page ownership: `PageManager`, the page allocator shared by all instances of a host.

It is made of parts over one page book (host/state/page_book.py: the free list, ref-counts,
pins, the guest-id mapping): allocation, release, pins, page-list checks and the prefix cache's
notes here; sharing in host/state/exports.py; suspension's moves in host/state/swap.py. The page
tables it fills are host/state/page_table.py's `InstancePages`.

A page is pinned while a forward or copy that reads or writes it is queued or running (the
scheduler pins at submit and unpins when the job ends), so a page an instance releases with a
write still queued cannot be handed to another instance before that write has landed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from host.state.exports import PageExports
from host.state.page_table import (
    ACTIVE,
    RESUMING,
    SUSPENDED,
    SUSPENDING,
    SWAPPED,
    InstancePages,
    PageError,
)
from host.state.swap import PageSwap

if TYPE_CHECKING:
    from gpu_backend.types import ForwardRequest

# (the page table's names, for the manager's users)
__all__ = ["ACTIVE", "RESUMING", "SUSPENDED", "SUSPENDING", "SWAPPED", "InstancePages", "PageError", "PageManager"]


class PageManager(PageExports, PageSwap):
    """Thread-safe page allocator shared by all instances of a host."""

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
            ids = self._new_ids(table, pages)
            for g in ids:
                table.held[g] = [1, True]
            table.owned_count += count
            self._tenant_pages[table.tenant] = held + count
            return ids

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
        phys = table.phys.get(page, page) if table.phys else page
        if entry[0] == 0:
            del table.held[page]
            table.drops += 1
            if entry[1]:
                table.owned_count -= 1
            if phys != page:
                del table.phys[page]
                table.guest.pop(phys, None)
        if phys != SWAPPED:
            self._unref(phys)

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
            if freed or self.watching:
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

    def check_step_pages(self, table: InstancePages, pages: list[int], writable_from: int) -> list[int]:
        """`check_pages`, and no page repeated, for a pass sent every token with the
        whole page list: O(pages added) when `pages` extends the list this table last passed here
        and the instance has dropped no page since (instead of a dict lookup per page per token:
        a 4k-token context is 256 pages). Returns the physical pages (`to_phys`, O(pages added) too)."""
        ok = table.checked
        n = len(ok)
        if n and table.checked_drops == table.drops and len(pages) >= n and pages[n - 1] == ok[-1] \
                and pages[:n] == ok:
            seen, new = table.checked_set, pages[n:]
        else:
            seen, new, n = set(), pages, 0
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
        if not table.phys:
            return pages
        table.checked_phys = phys = table.checked_phys[:n] + self.to_phys(table, new)
        return phys

    def check_writable(self, table: InstancePages, page: int) -> None:
        entry = table.held.get(page)
        if entry is None:
            raise PageError(f"page {page} is not held by this instance")
        if not entry[1]:
            raise PageError(f"page {page} is read-only here (imported)")

    def release_all(self, table: InstancePages) -> None:
        """Drop every hold of an ending instance and its non-persistent exports."""
        with self._lock:
            for key in [k for k, e in self._exports.items() if e.owner == table.owner and not e.persistent]:
                for p in self._exports.pop(key).pages:
                    self._unref(p)
            for g, entry in list(table.held.items()):
                p = table.phys.get(g, g) if table.phys else g
                if p != SWAPPED:
                    for _ in range(entry[0]):
                        self._unref(p)
            table.held.clear()
            table.phys.clear()
            table.guest.clear()
            table.drops += 1
            table.owned_count = 0
            table.ended = True
            table.swapped, table.swap_filled, table.swap = [], [], None
            self.swap_used -= table.swap_bytes
            table.swap_bytes = 0
            self._freed.notify_all()

    def tenant_pages(self, tenant: str) -> int:
        """Pages allocated by `tenant`'s instances and not let go yet (what its cap counts)."""
        with self._lock:
            return self._tenant_pages.get(tenant, 0)

    def usage(self, table: InstancePages) -> tuple[int, int, int]:
        """What `table`'s instance holds now: pages, the K/V slots written in them (its context,
        shared prefix pages included) and how many of its pages are swapped out."""
        with self._lock:
            filled = self._filled
            tokens = sum(table.swap_filled)
            for g in table.held:
                p = table.phys.get(g, g) if table.phys else g
                if p != SWAPPED:
                    tokens += filled[p]
            return len(table.held), tokens, len(table.swapped)

    # ---- the prefix cache ----
    def attach_prefix(self, table: InstancePages, tokens: Sequence[int]) -> list[int]:
        """Hold, read-only, the cached pages of the longest full-page prefix of `tokens` (a sequence
        from position 0); [] without a cache or a hit. They count against no instance's quota."""
        if self.cache is None:
            return []
        with self._lock:
            return self._hold_read_only(table, self.cache.lookup(tokens, table.tenant))

    def note_write(self, table: InstancePages, req: ForwardRequest, page_size: int,
                   context_len: int | None = None) -> None:
        """A checked pass of `table`'s instance is being queued: a frozen page (shared through the
        prefix cache) must not be written; the cache learns what the written pages hold.
        `context_len`: the request's, when the caller has it at hand."""
        ctx = req.context_len(page_size) if context_len is None else context_len
        # (a pass with input vectors holds what its token ids do not say: never cached, as a masked one)
        self._note(table, req.pages, page_size, ctx, req.tokens, req.positions,
                   req.mask is not None or bool(req.embeds))

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
