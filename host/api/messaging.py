"""WIT interface `messaging`: the client channel (send / receive) and pub/sub between instances."""

from __future__ import annotations

from host.api.guest import GuestError, Import, guest_import, timeout_s
from host.state.topics import Topics
from host.wasm.instance import Instance


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
        size = len(topic.encode()) + len(message.encode())
        if size > inst.published.max_bytes:
            raise GuestError(f"message of {size} bytes (topic included) exceeds the {inst.published.max_bytes}-byte "
                             "limit of a subscriber's queue")
        topics.publish(topic, message)

    @guest_import("messaging.subscribe")
    def subscribe(inst: Instance, topic: str) -> None:
        topics.subscribe(inst, topic)

    @guest_import("messaging.unsubscribe")
    def unsubscribe(inst: Instance, topic: str) -> None:
        topics.unsubscribe(inst, topic)

    @guest_import("messaging.receive-published")
    def receive_published(inst: Instance, timeout_ms: int | None) -> tuple[str, str] | None:
        if not inst.wait_until(lambda: bool(inst.published), timeout_s(timeout_ms)):
            return None
        with inst.cond:
            return inst.published.get()

    return {"send": send, "receive": receive, "publish": publish, "subscribe": subscribe,
            "unsubscribe": unsubscribe, "receive-published": receive_published}
