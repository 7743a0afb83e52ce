"""WIT interface `store`: the small persistent key-value store of inferlets, one namespace per
tenant (host/state/kvstore.py): an instance sees only its tenant's keys."""

from __future__ import annotations

from host.api.guest import GuestError, Import, guest_import
from host.state.kvstore import KeyValueStore, StoreFull
from host.wasm.instance import Instance


def imports(kvs: KeyValueStore) -> dict[str, Import]:
    @guest_import("store.get")
    def get(inst: Instance, key: str) -> str | None:
        return kvs.get(key, inst.pages.tenant)

    @guest_import("store.set")
    def set_(inst: Instance, key: str, value: str) -> None:
        try:
            kvs.set(key, value, inst.pages.tenant)
        except StoreFull as e:  # `set` has no error result: the caller traps, naming the limit
            raise GuestError(str(e)) from None

    @guest_import("store.delete")
    def delete(inst: Instance, key: str) -> None:
        kvs.delete(key, inst.pages.tenant)

    @guest_import("store.exists")
    def exists(inst: Instance, key: str) -> bool:
        return kvs.get(key, inst.pages.tenant) is not None

    @guest_import("store.list-keys")
    def list_keys(inst: Instance) -> list[str]:
        return kvs.keys(inst.pages.tenant)

    return {"get": get, "set": set_, "delete": delete, "exists": exists, "list-keys": list_keys}
