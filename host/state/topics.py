"""Publish/subscribe between instances: topic -> subscribers, delivery into each one's queue."""

from __future__ import annotations

import threading
from collections import deque
from typing import Protocol

__all__ = ["Mailbox", "Subscriber", "Topics"]


class Subscriber(Protocol):
    """Anything that can take a published message (an instance's messaging state)."""

    def deliver(self, topic: str, message: str) -> None: ...


class Mailbox:
    """One subscriber's unread published messages, bounded by count and bytes (UTF-8 of topic +
    message). When a new message does not fit, the oldest unread ones are dropped to make room
    (the publisher never waits for a slow subscriber); `dropped` counts them. A message larger
    than the whole byte budget is dropped itself. Not thread-safe: the owner's lock guards it.
    """

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        if max_messages < 1 or max_bytes < 1:
            raise ValueError(f"a mailbox needs room for a message, got {max_messages} messages / {max_bytes} bytes")
        self.max_messages, self.max_bytes = max_messages, max_bytes
        self._items: deque[tuple[str, str, int]] = deque()
        self.bytes = 0
        self.dropped = 0

    def put(self, topic: str, message: str) -> None:
        size = len(topic.encode()) + len(message.encode())
        if size > self.max_bytes:
            self.dropped += 1
            return
        items = self._items
        while items and (len(items) >= self.max_messages or self.bytes + size > self.max_bytes):
            self.bytes -= items.popleft()[2]
            self.dropped += 1
        items.append((topic, message, size))
        self.bytes += size

    def get(self) -> tuple[str, str] | None:
        if not self._items:
            return None
        topic, message, size = self._items.popleft()
        self.bytes -= size
        return topic, message

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)


class Topics:
    """Thread-safe registry of subscriptions. A subscriber is held only while subscribed."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscriber]] = {}
        self._lock = threading.Lock()

    def subscribe(self, sub: Subscriber, topic: str) -> None:
        with self._lock:
            self._subs.setdefault(topic, set()).add(sub)

    def unsubscribe(self, sub: Subscriber, topic: str) -> None:
        with self._lock:
            self._remove(sub, topic)

    def drop(self, sub: Subscriber) -> None:
        """Remove every subscription of `sub` (its instance ended)."""
        with self._lock:
            for topic in [t for t, subs in self._subs.items() if sub in subs]:
                self._remove(sub, topic)

    def _remove(self, sub: Subscriber, topic: str) -> None:
        subs = self._subs.get(topic)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[topic]

    def publish(self, topic: str, message: str) -> int:
        """Deliver `message` to every current subscriber of `topic`; returns how many got it."""
        with self._lock:
            subs = list(self._subs.get(topic, ()))
        for sub in subs:
            sub.deliver(topic, message)
        return len(subs)

    def topic_count(self) -> int:
        with self._lock:
            return len(self._subs)
