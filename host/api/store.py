"""WIT interface `store`: the small persistent key-value store shared by inferlets."""

from __future__ import annotations

from host.api.guest import Import, guest_import
from host.state.kvstore import KeyValueStore
from host.wasm.instance import Instance


def imports(kvs: KeyValueStore) -> dict[str, Import]:
    @guest_import("store.get")
    def get(inst: Instance, key: str) -> str | None:
        return kvs.get(key)

    @guest_import("store.set")
    def set_(inst: Instance, key: str, value: str) -> None:
        kvs.set(key, value)

    @guest_import("store.delete")
    def delete(inst: Instance, key: str) -> None:
        kvs.delete(key)

    @guest_import("store.exists")
    def exists(inst: Instance, key: str) -> bool:
        return kvs.get(key) is not None

    @guest_import("store.list-keys")
    def list_keys(inst: Instance) -> list[str]:
        return kvs.keys()

    return {"get": get, "set": set_, "delete": delete, "exists": exists, "list-keys": list_keys}
