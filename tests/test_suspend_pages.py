"""The page manager's side of suspension (host/state/pages.py, driven by host/suspend.py): what may
be moved, eviction to SWAPPED, restore into other pages with the guest's ids kept, and the
invariants (ref-count = holds + export names; free iff unreferenced) after each step."""

from __future__ import annotations

import pytest

from host.state.pages import SWAPPED, InstancePages, PageError, PageManager


def check(pm: PageManager, tables: list[InstancePages]) -> None:
    holds = [0] * pm.num_pages
    for t in tables:
        for g, (n, _w) in t.held.items():
            p = t.phys.get(g, g)
            if p != SWAPPED:
                holds[p] += n
        for p, g in t.guest.items():
            assert t.phys[g] == p, f"{t.owner}: guest {g} <-> page {p} maps one way only"
    for exp in pm._exports.values():  # noqa: SLF001
        for p in exp.pages:
            holds[p] += 1
    free = set(pm._free)  # noqa: SLF001
    for p in range(pm.num_pages):
        assert pm.refcount(p) == holds[p], f"page {p}: refcount {pm.refcount(p)} != holds {holds[p]}"
        assert (p in free) == (holds[p] == 0 and pm.pinned(p) == 0), f"page {p}"


def _suspend(pm: PageManager, t: InstancePages) -> list[int]:
    guests, phys = pm.own_pages(t)
    pm.pin(phys)
    assert pm.evict(t, guests, phys, swap=("copy", list(phys)), nbytes=len(phys) * 100)
    return phys


def test_only_pages_nobody_else_holds_move_and_ids_survive_a_resume_into_other_pages() -> None:
    pm = PageManager(8)
    a, b = InstancePages("a"), InstancePages("b")
    pa = pm.allocate(a, 4)
    assert isinstance(pa, list) and pa == [0, 1, 2, 3]
    assert pm.export(a, "shared", [pa[0]], persistent=False) is None  # exported: stays put
    pm.release(a, [pa[1]])
    moved = _suspend(pm, a)
    assert moved == [2, 3] and pm.swap_used == 200
    assert a.phys == {2: SWAPPED, 3: SWAPPED} and 2 in a.held  # the guest's ids stay held
    check(pm, [a, b])
    pb = pm.allocate(b, 5)  # takes the freed pages (1, 2, 3 among them)
    assert isinstance(pb, list) and {2, 3} <= set(pb)
    with pytest.raises(PageError, match="swapped out"):
        pm.to_phys(a, [0, 2])
    others = [p for p in pb if p not in (2, 3)]
    pm.release(b, others[:2])
    restored = pm.restore_pages(a)
    assert restored is not None and len(restored) == 2
    pm.settle(a, restored)
    assert pm.swap_used == 0
    assert pm.to_phys(a, [0, 2, 3]) == [0, *restored]  # the guest's ids, its pages
    assert {2, 3}.isdisjoint(restored)  # (2 and 3 went to b)
    check(pm, [a, b])
    # a new page for `a` whose physical id is one of a's guest ids gets another id
    pm.release(b, [p for p in pb if p not in others[:2]])
    got = pm.allocate(a, 5)  # every free page: physical 2 and 3 among them, ids a already uses
    assert isinstance(got, list)
    phys = pm.to_phys(a, got)
    assert {2, 3} <= set(phys)
    for g, p in zip(got, phys, strict=True):
        assert g == p or (p in (2, 3) and g >= 8)  # a synthetic id where the page's own is taken
    assert len(set(pm.to_phys(a, list(a.held)))) == len(a.held) == 8
    check(pm, [a, b])
    pm.release_all(a)
    pm.release_all(b)
    assert pm.free_count == 8 and not a.phys and not a.guest
    check(pm, [a, b])


def test_release_all_of_a_suspended_instance_frees_its_swap_and_keeps_the_pool_whole() -> None:
    pm = PageManager(6)
    a = InstancePages("a")
    assert isinstance(pm.allocate(a, 3), list)
    _suspend(pm, a)
    assert pm.free_count == 6 and pm.swap_used == 300
    pm.release_all(a)
    assert pm.swap_used == 0 and a.ended and pm.restore_pages(a) is None
    check(pm, [a])


def test_a_page_another_holder_took_meanwhile_aborts_the_eviction() -> None:
    pm = PageManager(4)
    a, b = InstancePages("a"), InstancePages("b")
    pa = pm.allocate(a, 2)
    assert isinstance(pa, list)
    guests, phys = pm.own_pages(a)
    pm.pin(phys)
    assert pm.export(a, "late", [pa[0]], persistent=False) is None  # shared after the copy began
    assert pm.import_(b, "late") == [pa[0]]
    assert not pm.evict(a, guests, phys, swap=None, nbytes=200)
    assert a.phys == {} and pm.swap_used == 0 and pm.pinned(pa[0]) == 0
    check(pm, [a, b])


def test_check_step_pages_translates_only_the_pages_added() -> None:
    pm = PageManager(8)
    a, b = InstancePages("a"), InstancePages("b")
    pa = pm.allocate(a, 2)
    assert isinstance(pa, list)
    _suspend(pm, a)
    pb = pm.allocate(b, 6)  # every free page but two
    assert isinstance(pb, list)
    pm.release(b, pb[:3])
    restored = pm.restore_pages(a)
    assert restored is not None
    pm.settle(a, restored)
    assert pm.check_step_pages(a, pa, writable_from=1) == restored
    more = pm.allocate(a, 1)
    assert isinstance(more, list)
    phys = pm.check_step_pages(a, pa + more, writable_from=2)
    assert phys[:2] == restored and phys[2] == pm.to_phys(a, more)[0] and len(set(phys)) == 3
    check(pm, [a, b])
