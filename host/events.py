"""What an instance reports: the event kinds, shared by the host, the server, the client and the CLIs.

Light on purpose: the client imports it, and the client must not pull in torch or wasmtime.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

__all__ = ["EVENT_KINDS", "LOG_STREAMS", "TERMINAL_EVENTS", "InstanceEvent", "print_log"]

EVENT_KINDS = ("message", "log", "completed", "exception", "aborted", "out_of_resources")
# An instance emits exactly one of these, last.
TERMINAL_EVENTS = frozenset(EVENT_KINDS[2:])
LOG_STREAMS = ("log", "stdout", "stderr")  # a `log` event's `stream`: runtime.log, or the guest's WASI output


@dataclass(frozen=True)
class InstanceEvent:
    """Something an instance did: `event` is one of EVENT_KINDS, `message` its text; a `log` event's
    `stream` says where the line came from (LOG_STREAMS), "" for every other event."""

    instance_id: str
    event: str
    message: str
    stream: str = ""

    @property
    def terminal(self) -> bool:
        return self.event in TERMINAL_EVENTS


def print_log(ev: InstanceEvent) -> None:
    """How `pie-run` shows a `log` event: on stderr, marked with its stream (stdout stays the
    inferlet's messages and return value, so a pipe gets only those)."""
    print(f"[{ev.stream or 'log'}] {ev.message}", file=sys.stderr, flush=True)
