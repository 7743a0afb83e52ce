"""WIT interface `messaging`: the client channel (send / receive) and pub/sub between instances.

Topics belong to a tenant, like KV exports: an instance publishes to and subscribes on its
tenant's topics only (the host keys them as TENANT NUL TOPIC; the guest sees its own names).
"""

from __future__ import annotations

from host.api.guest import GuestError, Import, guest_import, timeout_s
from host.state.topics import Topics
from host.wasm.instance import Instance


def _scoped(inst: Instance, topic: str) -> str:
    return f"{inst.pages.tenant}\0{topic}"


def imports(topics: Topics) -> dict[str, Import]:
    @guest_import("messaging.send")
    def send(inst: Instance, message: str) -> None:
        inst.check_alive()
        inst.emit("message", message)

    @guest_import("messaging.receive")
    def receive(inst: Instance, timeout_ms: int | None) -> str | None:
        if not inst.wait_until(lambda: bool(inst.inbox) or inst.input_closed, timeout_s(timeout_ms)):
            return None
        return inst.take_message()

    @guest_import("messaging.publish")
    def publish(inst: Instance, topic: str, message: str) -> None:
        scoped = _scoped(inst, topic)
        size = len(scoped.encode()) + len(message.encode())
        if size > inst.published.max_bytes:
            raise GuestError(f"message of {size} bytes (topic included) exceeds the {inst.published.max_bytes}-byte "
                             "limit of a subscriber's queue")
        topics.publish(scoped, message)

    @guest_import("messaging.subscribe")
    def subscribe(inst: Instance, topic: str) -> None:
        topics.subscribe(inst, _scoped(inst, topic))

    @guest_import("messaging.unsubscribe")
    def unsubscribe(inst: Instance, topic: str) -> None:
        topics.unsubscribe(inst, _scoped(inst, topic))

    @guest_import("messaging.receive-published")
    def receive_published(inst: Instance, timeout_ms: int | None) -> tuple[str, str] | None:
        if not inst.wait_until(lambda: bool(inst.published), timeout_s(timeout_ms)):
            return None
        with inst.cond:
            got = inst.published.get()
        if got is None:
            return None
        return got[0].split("\0", 1)[1], got[1]  # the guest's own topic name

    return {"send": send, "receive": receive, "publish": publish, "subscribe": subscribe,
            "unsubscribe": unsubscribe, "receive-published": receive_published}
