"""An instance's unread client messages: `Inbox`, bounded in bytes (`InboxFull` past the bound).

The instance (host/wasm/instance.py) holds it under its condition and wakes its guest when a
message comes; the guest's receive() (host/api/messaging.py) takes the oldest. Messages published
on topics go to the instance's `Mailbox` instead (host/state/topics.py).
"""

from __future__ import annotations

from collections import deque

__all__ = ["Inbox", "InboxFull"]


class InboxFull(Exception):
    """A client message refused: the instance's unread messages would pass `max_inbox_bytes`."""


class Inbox:
    """Unread messages, oldest first, and their UTF-8 size; the caller serializes access."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0  # UTF-8 bytes of the messages held
        self._messages: deque[str] = deque()

    def __len__(self) -> int:
        return len(self._messages)

    def put(self, message: str, owner: str) -> None:
        """Append `message` for instance `owner`; InboxFull if it would pass the bound."""
        size = len(message.encode("utf-8", "surrogatepass"))
        if self.bytes + size > self.limit:
            raise InboxFull(f"instance {owner} has {self.bytes} bytes of unread messages; this "
                            f"{size}-byte message would pass its inbox limit of {self.limit} bytes "
                            "(--max-inbox-kb); wait until it reads them")
        self._messages.append(message)
        self.bytes += size

    def take(self) -> str | None:
        """The oldest message, or None."""
        if not self._messages:
            return None
        message = self._messages.popleft()
        self.bytes -= len(message.encode("utf-8", "surrogatepass"))
        return message

    def clear(self) -> None:
        self._messages.clear()
        self.bytes = 0
