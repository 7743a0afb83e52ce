"""Publish/subscribe between instances: topic -> subscribers, delivery into each one's queue."""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["Subscriber", "Topics"]


class Subscriber(Protocol):
    """Anything that can take a published message (an instance's messaging state)."""

    def deliver(self, topic: str, message: str) -> None: ...


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
