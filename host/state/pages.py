"""KV page ownership: the host-wide free list, ref-counts, per-instance holdings and exports.

Export names belong to a tenant (the client identity that launched the exporter; "local" for
the embedded host and a server without tokens): an instance sees, imports and unexports only
its own tenant's exports, and a name in use within a tenant cannot be taken over.

Invariants (checked by tests): a page is on the free list iff its ref-count is 0 and no job
pins it; the ref-count of a page = holds by instances + 1 per export name that lists it; a page
is pinned while a forward or copy that reads or writes it is queued or running (the scheduler
pins at submit and unpins when the job ends), so a page an instance releases with a write still
queued cannot be handed to another instance before that write has landed.

Page ids a guest holds are its own (`InstancePages.held` is keyed by them): the same as the
physical page while the instance has never been suspended, and mapped to another one after it
was resumed into whatever pages were free (`InstancePages.phys` / `guest`, empty when identical,
so the common path does no translation). While suspended, its own pages' K/V sit in host memory
(host/suspend.py) and their ids map to SWAPPED. Everything the page manager stores in its
arrays, exports and the prefix cache is physical; what it hands a guest is the guest's id.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from host.state.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from gpu_backend.types import ForwardRequest
    from host.batching.generation import Generation


SWAPPED = -1  # InstancePages.phys value of a page whose K/V is in host memory while its instance is suspended

# InstancePages.state (host/suspend.py)
ACTIVE, SUSPENDING, SUSPENDED, RESUMING = "active", "suspending", "suspended", "resuming"


class PageError(Exception):
    """Guest misuse of page ids (a bug: the caller traps the instance)."""


@dataclass
class InstancePages:
    """The pages one instance holds: page -> [hold count, writable]."""

    owner: str
    tenant: str = "local"  # whose export names this instance sees (set by the host at launch)
    priority: int = 0  # its service level (host/levels.py: lower runs sooner; set at launch, runtime.set-priority)
    held: dict[int, list] = field(default_factory=dict)
    owned_count: int = 0  # pages this instance allocated and still holds (for its cap)
    replica: int = 0  # the engine replica the instance lives on (host/replicas.py); its pages are that one's
    drops: int = 0  # pages this instance stopped holding, ever: a page list checked before may be stale
    # the page list of its last per-token pass, found held and free of repeats while `drops` was
    # `checked_drops` (PageManager.check_step_pages)
    checked: list[int] = field(default_factory=list)
    checked_set: set[int] = field(default_factory=set)
    checked_drops: int = -1
    checked_phys: list[int] = field(default_factory=list)  # `checked` translated (when `phys` is not empty)
    # guest id -> physical page where they differ, and back (both empty until a resume moved a page;
    # a swapped-out page maps to SWAPPED). Synthetic guest ids count up from `next_id` (>= num_pages).
    phys: dict[int, int] = field(default_factory=dict)
    guest: dict[int, int] = field(default_factory=dict)
    next_id: int = 0
    # suspension (host/suspend.py): the state, guarded by `touch`, which the instance's thread holds
    # from checking it to having pinned the pages a call queues work on
    state: str = ACTIVE
    touch: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False  # release_all ran: nothing may be restored into this table
    moves: int = 0  # suspensions so far: work prepared on the physical pages of before is stale
    swapped: list[int] = field(default_factory=list)  # guest ids of the pages swapped out, in order
    swap_filled: list[int] = field(default_factory=list)  # their `filled` marks
    swap: object = None  # the backend's host-memory copy of their K/V
    swap_bytes: int = 0
    gate: object = None  # host/suspend.py's gate for this instance's page-touching calls
    loop: Generation | None = None  # the host-side generation loop it runs (ended with out-of-pages to suspend it)


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
        self.swap_used = 0  # bytes of host memory held by suspended instances' pages (host/suspend.py)
        self.watching = 0  # threads waiting for pins to drop (host/suspend.py): unpin notifies them
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
            ids = self._new_ids(table, pages)
            for g in ids:
                table.held[g] = [1, True]
            table.owned_count += count
            self._tenant_pages[table.tenant] = held + count
            return ids

    # ---- guest ids <-> physical pages ----
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
            self._exports[key] = _Export(phys, table.owner, persistent)
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

    # ---- suspension: the instance's own pages out to host memory and back (host/suspend.py) ----
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

    def refcount(self, page: int) -> int:
        return self._refs[page]

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
