"""The automatic prefix cache: full KV pages indexed by a chained hash of their tokens.

A page is *registered* once it is full and every token in it was written causally (no mask) at
the standard positions of a sequence that starts at slot 0 of its first page, and the pages
before it are registered as its chain. Its key is blake2b(key of the page before it, its tokens),
the first page's parent being the root of its salt (the tenant in `per-client` mode, nothing in
`shared` mode), so a key covers every token before it. A registered page keeps its K/V after its
holders let go: it waits in an LRU list, counts as free, and is evicted (oldest first) only when
an allocation needs it; a page someone holds is never evicted. `lookup` hands out the longest
registered prefix of a token list; a page handed out is *frozen*: nobody writes it again (its
owner's write traps), since others read it. Not thread-safe: `PageManager` holds its lock.

Timing side channel: in `shared` mode, a request that hits the cache gets its first token sooner,
so a client can learn whether another client recently sent a prompt with the same prefix.
`per-client` (the default) keeps each tenant's entries apart; `off` disables the cache.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PREFIX_CACHE_MODES", "PrefixCache", "PrefixCacheStats"]

PREFIX_CACHE_MODES = ("per-client", "shared", "off")


def _key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.blake2b(parent + array("I", tokens).tobytes(), digest_size=16).digest()


@dataclass
class PrefixCacheStats:
    lookups: int = 0
    hits: int = 0  # lookups that attached at least one page
    tokens_saved: int = 0  # tokens whose prefill a hit made unnecessary
    evictions: int = 0


class PrefixCache:
    """Index, LRU list and write tracking of the pages of one host (see the module docstring)."""

    def __init__(self, page_size: int, mode: str = "per-client") -> None:
        if mode not in PREFIX_CACHE_MODES:
            raise ValueError(f"unknown prefix cache mode {mode!r}: use one of {', '.join(PREFIX_CACHE_MODES)}")
        self.page_size = page_size
        self.mode = mode
        self.stats = PrefixCacheStats()
        self._partial: dict[int, list[int]] = {}  # page -> tokens written cleanly from slot 0 so far
        self._key: dict[int, bytes] = {}  # registered page -> its key
        self._parent: dict[int, bytes] = {}  # registered page -> the key its chain continues
        self._index: dict[bytes, int] = {}  # key -> registered page
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered pages nobody holds, oldest first
        self.frozen: set[int] = set()  # registered pages handed out by lookup: written by nobody

    def root(self, tenant: str) -> bytes:
        return _key(tenant.encode(), ()) if self.mode == "per-client" else b""

    @property
    def entries(self) -> int:
        return len(self._index)

    @property
    def idle(self) -> int:
        """Registered pages nobody holds: free for allocation."""
        return len(self._lru)

    # ---- writes ----
    def note_write(self, pages: Sequence[int], ctx: int, tokens: Sequence[int], positions: Sequence[int],
                   masked: bool, tenant: str) -> None:
        """A pass writes `tokens` after `ctx` tokens into `pages`: keep track of what each page holds."""
        ps, n = self.page_size, len(tokens)
        if n == 1 and not masked and positions[0] == ctx and self.mode != "off":  # a decode step: O(1)
            j, slot = divmod(ctx, ps)
            p = pages[j]
            part = self._partial.get(p)
            if slot and part is not None and len(part) == slot and p not in self._key:
                part.append(tokens[0])
                if slot == ps - 1:
                    del self._partial[p]
                    parent = self._chain_parent(pages, j, tenant)
                    if parent is not None:
                        self._register(p, _key(parent, part), parent)
                return
        clean = (self.mode != "off" and not masked and positions[0] == ctx and positions[-1] == ctx + n - 1
                 and (n < 3 or list(positions) == list(range(ctx, ctx + n))))
        for j in range(ctx // ps, len(pages)):
            p = pages[j]
            lo, hi = max(ctx - j * ps, 0), min(ctx + n - j * ps, ps)
            if hi <= lo:
                break
            if p in self._key:
                self._unregister(p)  # its owner writes it again (the caller refused it if frozen)
            part = [] if lo == 0 else self._partial.get(p)
            if not clean or part is None or len(part) != lo:
                self._partial.pop(p, None)
                continue
            part = part[:lo] + list(tokens[j * ps + lo - ctx : j * ps + hi - ctx])
            if hi < ps:
                self._partial[p] = part
                continue
            self._partial.pop(p, None)
            parent = self._chain_parent(pages, j, tenant)
            if parent is not None:
                self._register(p, _key(parent, part), parent)

    def forget(self, pages: Sequence[int]) -> None:
        """What these pages hold is no longer known (a failed pass, a copy into them)."""
        for p in pages:
            self._partial.pop(p, None)
            if p in self._key:
                self._unregister(p)

    def clear(self) -> list[int]:
        """Forget everything (the KV cache behind the pages was lost); returns the idle pages, which
        the caller puts back on its free list."""
        idle = list(self._lru)
        self.forget(list(self._key))
        self._partial.clear()
        return idle

    def _chain_parent(self, pages: Sequence[int], j: int, tenant: str) -> bytes | None:
        """The key page j continues, if pages[0..j-1] are a registered chain from the root."""
        expected = self.root(tenant)
        for p in pages[:j]:
            key = self._key.get(p)
            if key is None or self._parent[p] != expected:
                return None
            expected = key
        return expected

    def _register(self, page: int, key: bytes, parent: bytes) -> None:
        if key in self._index:
            return  # the same tokens are cached already: keep the older page
        self._index[key] = page
        self._key[page] = key
        self._parent[page] = parent

    def _unregister(self, page: int) -> None:
        del self._index[self._key.pop(page)]
        del self._parent[page]
        self._lru.pop(page, None)
        self.frozen.discard(page)

    # ---- lifecycle ----
    def keep(self, page: int) -> bool:
        """Nobody holds `page` any more: True if the cache keeps it (idle, evictable), else it is free."""
        self._partial.pop(page, None)
        if page not in self._key:
            return False
        self._lru[page] = None
        return True

    def evict(self) -> int | None:
        """Take the least recently used idle page out of the cache (for an allocation)."""
        if not self._lru:
            return None
        page, _ = self._lru.popitem(last=False)
        self._unregister(page)
        self.stats.evictions += 1
        return page

    def lookup(self, tokens: Sequence[int], tenant: str) -> list[int]:
        """The registered pages holding the longest full-page prefix of `tokens` (read from slot 0 at
        positions 0..); they leave the idle list, the caller takes a hold on each."""
        self.stats.lookups += 1
        if self.mode == "off":
            return []
        ps, parent, found = self.page_size, self.root(tenant), []
        for start in range(0, len(tokens) - ps + 1, ps):
            key = _key(parent, tokens[start : start + ps])
            page = self._index.get(key)
            if page is None:
                break
            found.append(page)
            parent = key
        for p in found:
            self._lru.pop(p, None)
            self.frozen.add(p)
        if found:
            self.stats.hits += 1
            self.stats.tokens_saved += len(found) * ps
        return found

    def as_dict(self) -> dict[str, int | str]:
        s = self.stats
        return {"mode": self.mode, "lookups": s.lookups, "hits": s.hits, "tokens_saved": s.tokens_saved,
                "entries": self.entries, "idle": self.idle, "evictions": s.evictions}
