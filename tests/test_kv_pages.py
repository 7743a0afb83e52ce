"""PageManager: ownership, ref-counts, exports; invariants hold after every operation."""

from __future__ import annotations

import pytest

from host.state.pages import InstancePages, PageError, PageManager


def check_invariants(pm: PageManager, tables: list[InstancePages]) -> None:
    holds = [0] * pm.num_pages
    for t in tables:
        for p, (n, _w) in t.held.items():
            holds[p] += n
    for exp in pm._exports.values():
        for p in exp.pages:
            holds[p] += 1
    free = set(pm._free)
    assert len(free) == len(pm._free), "a page is on the free list twice"
    for p in range(pm.num_pages):
        assert pm.refcount(p) == holds[p], f"page {p}: refcount {pm.refcount(p)} != holds {holds[p]}"
        assert (p in free) == (holds[p] == 0), f"page {p}: free={p in free} but holds={holds[p]}"


def test_allocate_release_and_limits() -> None:
    pm = PageManager(8, max_pages_per_instance=5)
    a, b = InstancePages("a"), InstancePages("b")
    pa = pm.allocate(a, 4)
    assert isinstance(pa, list) and len(set(pa)) == 4
    assert "instance page limit" in pm.allocate(a, 2)
    pb = pm.allocate(b, 4)
    assert isinstance(pb, list) and not set(pa) & set(pb)
    assert "out of KV pages" in pm.allocate(b, 1)
    assert "only 8 in total" in pm.allocate(b, 100)
    check_invariants(pm, [a, b])
    with pytest.raises(PageError, match=f"page {pb[0]} is not held"):
        pm.release(a, [pb[0]])  # another instance's page
    pm.release(a, pa[:2])
    with pytest.raises(PageError, match="double release"):
        pm.release(a, [pa[0]])
    with pytest.raises(PageError):
        pm.release(a, [pa[2], pa[2]])  # same page twice in one call
    check_invariants(pm, [a, b])
    pm.release_all(a)
    pm.release_all(b)
    assert pm.free_count == 8
    check_invariants(pm, [a, b])


def test_export_import_refcounts_and_read_only() -> None:
    pm = PageManager(6)
    a, b, c = InstancePages("a"), InstancePages("b"), InstancePages("c")
    pages = pm.allocate(a, 3)
    assert isinstance(pages, list)
    assert pm.export(a, "prefix", pages[:2], persistent=False) is None
    assert "already in use" in pm.export(a, "prefix", pages[:1], persistent=False)
    assert pm.list_exports(b) == [("prefix", 2)]
    got = pm.import_(b, "prefix")
    assert got == pages[:2]
    assert "no export" in pm.import_(c, "nope")
    with pytest.raises(PageError, match="read-only"):
        pm.check_pages(b, got, writable_from=1)
    pm.check_pages(b, got, writable_from=2)  # reading imported pages is fine
    check_invariants(pm, [a, b, c])
    pm.release_all(a)  # exporter ends: its non-persistent export goes, b still holds the pages
    assert pm.list_exports(b) == []
    assert pm.free_count == 6 - 2
    check_invariants(pm, [a, b, c])
    pm.release(b, got)
    assert pm.free_count == 6
    check_invariants(pm, [a, b, c])


def test_persistent_export_outlives_exporter() -> None:
    pm = PageManager(4)
    a, b = InstancePages("a"), InstancePages("b")
    pages = pm.allocate(a, 2)
    assert isinstance(pages, list)
    pm.export(a, "keep", pages, persistent=True)
    pm.release_all(a)
    assert pm.free_count == 2
    assert pm.import_(b, "keep") == pages
    assert pm.unexport(b, "keep") is None
    assert "no export" in pm.unexport(b, "keep")
    pm.release_all(b)
    assert pm.free_count == 4
    check_invariants(pm, [a, b])


def test_a_pinned_page_stays_off_the_free_list_until_unpinned() -> None:
    pm = PageManager(4)
    t = InstancePages("a")
    (p,) = pm.allocate(t, 1)  # type: ignore[misc]
    pm.pin([p])
    pm.release(t, [p])
    assert pm.free_count == 3 and p not in pm.allocate(InstancePages("b"), 3)  # type: ignore[operator]
    pm.unpin([p])
    assert pm.free_count == 1 and pm.refcount(p) == 0 and pm.pinned(p) == 0
    assert pm.allocate(InstancePages("c"), 1) == [p]


def test_export_names_belong_to_a_tenant() -> None:
    pm = PageManager(6)
    alice, alice2 = InstancePages("a1", tenant="alice"), InstancePages("a2", tenant="alice")
    mallory = InstancePages("m", tenant="mallory")
    pages = pm.allocate(alice, 2)
    assert isinstance(pages, list)
    assert pm.export(alice, "prefix", pages, persistent=True) is None
    # another tenant neither sees, imports, removes nor takes the name over
    assert pm.list_exports(mallory) == []
    assert "no export" in pm.import_(mallory, "prefix")
    assert "no export" in pm.unexport(mallory, "prefix")
    own = pm.allocate(mallory, 1)
    assert isinstance(own, list) and pm.export(mallory, "prefix", own, persistent=False) is None
    assert pm.list_exports(mallory) == [("prefix", 1)]
    # the same tenant shares it across instances
    pm.release_all(alice)
    assert pm.import_(alice2, "prefix") == pages
    assert pm.unexport(alice2, "prefix") is None
    pm.release_all(alice2)
    pm.release_all(mallory)
    assert pm.free_count == 6
    check_invariants(pm, [alice, alice2, mallory])


def _reference_step_check(pm: PageManager, t: InstancePages, pages: list[int], writable_from: int) -> None:
    """What check_step_pages must decide, checked from scratch: held, writable from there, no repeat."""
    pm.check_pages(t, pages, writable_from)
    if len(set(pages)) != len(pages):
        raise PageError("the page list repeats a page")


def test_step_page_check_is_incremental_but_decides_like_a_full_check() -> None:
    """A guest sends its whole page list every token; the host checks only what changed since the last
    list it accepted, yet must refuse exactly what a full check refuses: a foreign page anywhere, a
    repeat, a page dropped since, a read-only page where tokens are written."""
    import random

    rng = random.Random(7)
    pm = PageManager(2000)
    t, other = InstancePages("a"), InstancePages("b")
    mine = pm.allocate(t, 60)
    foreign = pm.allocate(other, 10)
    assert isinstance(mine, list) and isinstance(foreign, list)
    assert pm.export(other, "shared", foreign[:3], persistent=False) is None
    read_only = pm.import_(t, "shared")  # held by `t`, read-only
    assert isinstance(read_only, list)
    pages: list[int] = mine[:4]
    outcomes = {True: 0, False: 0}
    for _ in range(3000):
        op = rng.random()
        held = [p for p in t.held]
        if op < 0.45:
            nxt = pages + [rng.choice(held)]  # the next page of a growing context (maybe a repeat)
        elif op < 0.55:
            nxt = pages + [rng.choice(foreign[3:])]  # somebody else's page
        elif op < 0.65 and pages:
            nxt = list(pages)
            nxt[rng.randrange(len(nxt))] = rng.choice(held + foreign)  # an earlier entry changed
        elif op < 0.72:
            nxt = list(pages)  # the same list again
        elif op < 0.78 and len(pages) > 1:
            nxt = pages[: rng.randrange(1, len(pages))]  # a shorter one (trimmed)
        elif op < 0.85:
            owned = [p for p in t.held if t.held[p][1]]
            if len(owned) > 8:
                listed = [p for p in pages if p in owned]
                pm.release(t, [rng.choice(listed if listed and rng.random() < 0.7 else owned)])  # maybe a listed one
                pm.allocate(other, 1)  # the page it dropped may now be somebody else's
                if rng.random() < 0.5:
                    pm.allocate(t, 1)
            nxt = list(pages)
        else:
            nxt = rng.sample(held, min(len(held), rng.randrange(1, 6)))  # a fresh list
        if not nxt:
            continue
        wf = rng.choice([len(nxt) - 1, len(nxt) - 1, 0, max(len(nxt) - 2, 0)])
        try:
            _reference_step_check(pm, t, nxt, wf)
            ok = True
        except PageError:
            ok = False
        try:
            pm.check_step_pages(t, nxt, wf)
            got = True
        except PageError:
            got = False
        assert got == ok, (nxt, wf)
        outcomes[ok] += 1
        if ok and rng.random() < 0.9:
            pages = nxt
        elif not ok and rng.random() < 0.5:
            pages = [p for p in dict.fromkeys(pages) if p in t.held and t.held[p][1]] or [pm.allocate(t, 1)[0]]
    assert outcomes[True] > 300 and outcomes[False] > 300  # both sides exercised


def test_filled_is_the_high_water_mark_of_slots_written_since_allocation() -> None:
    """`filled` (what step lookahead must not overwrite): raised by passes and copies, never lowered
    by a rewrite of earlier slots, back to 0 when the page is allocated again."""
    from gpu_backend.types import ForwardRequest

    pm = PageManager(2)
    t = InstancePages("a")
    p, q = pm.allocate(t, 2)  # type: ignore[misc]
    assert (pm.filled(t, p), pm.filled(t, q)) == (0, 0)
    pm.note_write(t, ForwardRequest(pages=[p, q], last_page_len=1, tokens=[1, 2, 3, 4, 5],
                                    positions=[0, 1, 2, 3, 4]), 4)
    assert (pm.filled(t, p), pm.filled(t, q)) == (4, 1)
    pm.note_write(t, ForwardRequest(pages=[p, q], last_page_len=2, tokens=[6], positions=[5]), 4)
    assert pm.filled(t, q) == 2
    pm.note_write(t, ForwardRequest(pages=[p], last_page_len=2, tokens=[7], positions=[1]), 4)  # back at 1
    pm.note_write(t, ForwardRequest(pages=[p, q], last_page_len=1, tokens=[8], positions=[4]), 4)
    assert (pm.filled(t, p), pm.filled(t, q)) == (4, 2)
    pm.note_copy(t, q, 3)
    assert pm.filled(t, q) == 3
    pm.release(t, [q])
    (again,) = pm.allocate(t, 1)  # type: ignore[misc]
    assert again == q and pm.filled(t, again) == 0
