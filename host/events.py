"""What an instance reports: the event kinds, shared by the host, the server, the client and the CLIs.

Light on purpose: the client imports it, and the client must not pull in torch or wasmtime.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EVENT_KINDS", "TERMINAL_EVENTS", "InstanceEvent"]

EVENT_KINDS = ("message", "completed", "exception", "aborted", "out_of_resources")
# An instance emits exactly one of these, last.
TERMINAL_EVENTS = frozenset(EVENT_KINDS[1:])


@dataclass(frozen=True)
class InstanceEvent:
    """Something an instance did: `event` is one of EVENT_KINDS, `message` its text."""

    instance_id: str
    event: str
    message: str

    @property
    def terminal(self) -> bool:
        return self.event in TERMINAL_EVENTS
