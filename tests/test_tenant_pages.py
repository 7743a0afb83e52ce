"""KV pages per tenant (issue 37): a tenant's instances together hold at most max_pages_per_tenant,
counted from allocation until a page is let go, so exports cannot carry a tenant past its cap."""

from __future__ import annotations

from host.state.pages import InstancePages, PageManager


def _table(owner: str, tenant: str) -> InstancePages:
    return InstancePages(owner, tenant=tenant)


def test_a_tenant_is_capped_and_another_is_not_affected() -> None:
    pm = PageManager(16, max_pages_per_tenant=6)
    a1, a2, b = _table("a1", "alice"), _table("a2", "alice"), _table("b", "bob")
    assert isinstance(pm.allocate(a1, 4), list)
    refused = pm.allocate(a2, 3)
    assert isinstance(refused, str) and "tenant page limit" in refused and "'alice' hold 4" in refused
    assert isinstance(pm.allocate(a2, 2), list)  # up to the cap
    assert isinstance(pm.allocate(b, 6), list)  # bob has his own six
    pm.release_all(a1)
    assert pm.tenant_pages("alice") == 2 and isinstance(pm.allocate(a2, 4), list)


def test_persistent_exports_count_until_their_pages_are_let_go() -> None:
    pm = PageManager(16, max_pages_per_tenant=4)
    first = _table("i1", "alice")
    pages = pm.allocate(first, 4)
    assert isinstance(pages, list)
    assert pm.export(first, "hoard", pages, persistent=True) is None
    pm.release_all(first)  # the instance ended; its persistent export keeps the pages
    second = _table("i2", "alice")
    assert pm.tenant_pages("alice") == 4 and isinstance(pm.allocate(second, 1), str)
    assert pm.unexport(second, "hoard") is None  # the export goes: the pages are free again
    assert pm.tenant_pages("alice") == 0 and isinstance(pm.allocate(second, 4), list)
    pm.release_all(second)
    assert pm.free_count == 16 and pm.tenant_pages("alice") == 0
