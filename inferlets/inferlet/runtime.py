"""Thin wrappers over the runtime, messaging and store interfaces."""

from __future__ import annotations

from inferlet import _host

__all__ = [
    "args", "version", "instance_id", "set_return", "log", "elapsed_ms", "set_priority", "priority",
    "send", "receive", "publish", "subscribe", "unsubscribe", "receive_published",
    "store_get", "store_set", "store_delete", "store_exists", "store_keys",
]  # fmt: skip


def args() -> list[str]:
    """The instance's arguments, like `sys.argv[1:]`."""
    return list(_host.runtime.arguments())


def version() -> str:
    """The host's version string."""
    return _host.runtime.version()


def instance_id() -> str:
    """This instance's id."""
    return _host.runtime.instance_id()


def set_return(value: str) -> None:
    """Set the value reported to the client when the instance completes."""
    _host.runtime.set_return(value)


def log(message: str) -> None:
    """A debug line in the host's log, tagged with this instance's id."""
    _host.runtime.log(message)


def elapsed_ms() -> int:
    """Milliseconds since this instance started (monotonic)."""
    return _host.runtime.elapsed_ms()


def set_priority(priority: int) -> None:
    """Change this instance's priority (from -1000 to 1000, lower runs sooner, default 0 or the
    launch's): its forwards queued from now on go by it when batches are full, and so does its place
    under KV pressure. A value out of range (or not an int) is a bug: the host traps the instance.
    Needs a host serving WIT 0.4.0."""
    _host.runtime.set_priority(priority)


def priority() -> int:
    """This instance's priority: the launch's, or the last `set_priority`."""
    return _host.runtime.priority()


def send(message: str) -> None:
    """Send a message to the client."""
    _host.messaging.send(message)


def receive(timeout_ms: int | None = None) -> str | None:
    """Block for the client's next message; None on timeout or when the client can send no more."""
    return _host.messaging.receive(timeout_ms)


def publish(topic: str, message: str) -> None:
    """Publish `message` to every instance subscribed to `topic`."""
    _host.messaging.publish(topic, message)


def subscribe(topic: str) -> None:
    """Queue messages published on `topic` from now on for `receive_published`."""
    _host.messaging.subscribe(topic)


def unsubscribe(topic: str) -> None:
    """Stop receiving `topic`'s messages."""
    _host.messaging.unsubscribe(topic)


def receive_published(timeout_ms: int | None = None) -> tuple[str, str] | None:
    """Block for the next published message on a subscribed topic: (topic, message), or None."""
    got = _host.messaging.receive_published(timeout_ms)
    return None if got is None else (got[0], got[1])


def store_get(key: str) -> str | None:
    """The value stored under `key` in the host's shared key-value store, or None."""
    return _host.store.get(key)


def store_set(key: str, value: str) -> None:
    """Store `value` under `key`."""
    _host.store.set(key, value)


def store_delete(key: str) -> None:
    """Delete `key` (no error when absent)."""
    _host.store.delete(key)


def store_exists(key: str) -> bool:
    """Whether `key` is stored."""
    return _host.store.exists(key)


def store_keys() -> list[str]:
    """All stored keys."""
    return list(_host.store.list_keys())
