"""The automatic prefix cache in the page manager: what is cached, who sees it, eviction, freezing."""

from __future__ import annotations

import pytest

from gpu_backend.types import ForwardRequest
from host.state.pages import InstancePages, PageError, PageManager
from host.state.prefix_cache import PrefixCache

PS = 4


def manager(num_pages: int = 16, mode: str = "per-client") -> PageManager:
    return PageManager(num_pages, cache=PrefixCache(PS, mode))


def prefill(pm: PageManager, table: InstancePages, tokens: list[int], positions: list[int] | None = None,
            mask: bool = False) -> list[int]:
    """Allocate pages for `tokens` and note one causal pass over them (what the host does at submit)."""
    n = len(tokens)
    pages = pm.allocate(table, -(-n // PS))
    assert isinstance(pages, list)
    req = ForwardRequest(pages=pages, last_page_len=n - (len(pages) - 1) * PS, tokens=tokens,
                         positions=positions if positions is not None else list(range(n)),
                         mask=[[i + 1] for i in range(n)] if mask else None)
    pm.note_write(table, req, PS)
    return pages


def test_full_pages_of_a_causal_prefill_are_found_after_their_owner_lets_go() -> None:
    pm = manager()
    a = InstancePages("a")
    pages = prefill(pm, a, list(range(10, 21)))  # 11 tokens: 2 full pages + 3
    pm.release_all(a)
    assert pm.free_count == 16  # cached pages nobody holds count as free
    b = InstancePages("b")
    got = pm.attach_prefix(b, list(range(10, 30)))
    assert got == pages[:2]  # the partial last page is never shared
    assert all(not b.held[p][1] for p in got) and b.owned_count == 0  # read-only, no quota
    assert pm.attach_prefix(InstancePages("c"), [10, 11, 12, 99, 14, 15, 16, 17]) == []  # differs in page 1
    assert pm.attach_prefix(InstancePages("d"), [10, 11, 12, 13, 14, 15, 16, 99]) == pages[:1]
    stats = pm.cache.as_dict()  # type: ignore[union-attr]
    assert stats["hits"] == 2 and stats["tokens_saved"] == 12 and stats["entries"] == 2


def test_masked_or_custom_positions_are_not_cached() -> None:
    pm = manager()
    a = InstancePages("a")
    prefill(pm, a, list(range(8)), positions=[0, 1, 2, 3, 4, 5, 7, 6])
    prefill(pm, a, list(range(50, 58)), mask=True)
    pm.release_all(a)
    assert pm.attach_prefix(InstancePages("b"), list(range(9))) == []
    assert pm.attach_prefix(InstancePages("b"), list(range(50, 59))) == []
    assert pm.cache.entries == 0  # type: ignore[union-attr]


def test_per_client_entries_are_salted_by_tenant_and_shared_mode_is_not() -> None:
    for mode, other_sees in (("per-client", False), ("shared", True)):
        pm = manager(mode=mode)
        alice = InstancePages("a", tenant="alice")
        pages = prefill(pm, alice, list(range(9)))
        pm.release_all(alice)
        assert pm.attach_prefix(InstancePages("b", tenant="bob"), list(range(9))) == (pages[:2] if other_sees else [])
        assert pm.attach_prefix(InstancePages("c", tenant="alice"), list(range(9))) == pages[:2]


def test_eviction_is_lru_and_never_takes_a_held_page() -> None:
    pm = manager(num_pages=6)
    a, b = InstancePages("a"), InstancePages("b")
    first = prefill(pm, a, list(range(8)))  # 2 full pages
    second = prefill(pm, b, list(range(100, 108)))  # 2 full pages
    pm.release_all(a)
    pm.release_all(b)
    keep = InstancePages("keep")
    assert pm.attach_prefix(keep, list(range(100, 109))) == second  # held again: not evictable
    got = pm.allocate(InstancePages("c"), 4)  # 2 free + the 2 idle cached pages of `first`
    assert isinstance(got, list) and set(first) <= set(got) and not set(second) & set(got)
    assert "out of KV pages" in pm.allocate(InstancePages("d"), 1)  # type: ignore[operator]
    assert pm.cache.stats.evictions == 2  # type: ignore[union-attr]
    assert pm.attach_prefix(InstancePages("e"), list(range(9))) == []


def test_a_page_handed_out_by_the_cache_cannot_be_written_again() -> None:
    pm = manager()
    owner = InstancePages("owner")
    pages = prefill(pm, owner, list(range(9)))
    assert pm.attach_prefix(InstancePages("reader"), list(range(9))) == pages[:2]
    rewrite = ForwardRequest(pages=pages[:2], last_page_len=PS, tokens=[7], positions=[7])
    with pytest.raises(PageError, match="shared through the prefix cache"):
        pm.note_write(owner, rewrite, PS)
    with pytest.raises(PageError, match="shared through the prefix cache"):
        pm.note_copy(owner, pages[1], 1)


def test_content_that_failed_or_was_overwritten_is_forgotten() -> None:
    pm = manager()
    a = InstancePages("a")
    pages = prefill(pm, a, list(range(9)))
    pm.forget_content(pages[1:2])  # the pass that wrote page 1 failed
    pm.release_all(a)
    assert pm.attach_prefix(InstancePages("b"), list(range(9))) == pages[:1]
    c = InstancePages("c")
    own = prefill(pm, c, list(range(40, 45)))
    over = ForwardRequest(pages=own[:1], last_page_len=2, tokens=[77], positions=[1])  # rewrite slot 1
    pm.note_write(c, over, PS)
    pm.release_all(c)
    assert pm.attach_prefix(InstancePages("d"), list(range(40, 45))) == []


@pytest.mark.parametrize("offset", [0, 3])
def test_a_generation_loop_notes_its_writes_as_its_steps_would_one_by_one(offset: int) -> None:
    """A host-side loop notes its steps' writes a page at a time (and when it ends). The cache and
    the pages' write marks must come out as if each step had been noted when it was queued, and a
    page must be in the cache from the step that fills it on (a request arriving meanwhile finds
    it). The reference is a second loop, in step with the first, whose steps are noted one by one
    with `note_write`. With `offset`, positions run ahead of the slots: not cacheable either way."""
    from gpu_backend.types import SamplerParams
    from host.batching.generation import Generation, StopRules

    drawn = list(range(40, 53))  # 13 drawn after a 5-token prompt: 17 slots written (the last drawn is not)
    runs = []
    for _ in range(2):
        pm = manager()
        a = InstancePages("a")
        pages = pm.allocate(a, 2)
        assert isinstance(pages, list)
        first = ForwardRequest(pages=list(pages), last_page_len=1, tokens=[1, 2, 3, 4, 5],
                               positions=[i + offset for i in range(5)])
        pm.note_write(a, first, PS)
        gen = Generation(first, SamplerParams(), StopRules(len(drawn), frozenset(), (), 1000), PS, pm, a,
                         lambda ids: "", None)
        runs.append((pm, a, gen))
    (pm, a, gen), (ref, ra, rgen) = runs
    rgen._noted = 10**9  # the reference loop's own notes off: each of its steps is noted below
    for i, tok in enumerate(drawn):
        ended, rended = gen.advance(tok), rgen.advance(tok)
        assert ended == rended == (i == len(drawn) - 1)
        if not rended:
            ref.note_write(ra, rgen.request, PS)
        assert pm.cache.entries == ref.cache.entries  # type: ignore[union-attr]
        full = gen.request.pages[:-1]  # every page before the one being written is full and noted
        assert [pm.filled(a, p) for p in full] == [ref.filled(ra, p) for p in rgen.request.pages[:-1]]
    gen.note_writes()  # what the scheduler does when the loop ends
    pages = gen.request.pages
    assert pages == rgen.request.pages
    assert [pm.filled(a, p) for p in pages] == [ref.filled(ra, p) for p in pages] == [4, 4, 4, 4, 1]
    tokens = [1, 2, 3, 4, 5] + drawn
    pm.release_all(a)
    ref.release_all(ra)
    got = pm.attach_prefix(InstancePages("b"), tokens)
    assert got == ref.attach_prefix(InstancePages("b"), tokens)
    assert got == ([] if offset else pages[:4])
