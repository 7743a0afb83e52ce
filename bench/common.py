"""Shared by the bench scripts (imported as a sibling: run the scripts as `python bench/NAME.py`)."""

from __future__ import annotations

import queue
from pathlib import Path

from host import Host, InstanceEvent
from host.cli.build import resolve_inferlet

ROOT = Path(__file__).resolve().parent.parent


class Run:
    """One instance's events, collected until its terminal event."""

    def __init__(self, host: Host, program: str, args: list[str]) -> None:
        self.events: queue.Queue[InstanceEvent] = queue.Queue()
        self.messages: list[str] = []
        self.id = host.launch(program, args, self.events.put)
        self.end: InstanceEvent | None = None

    def finish(self, timeout: float = 300.0) -> InstanceEvent:
        while self.end is None:
            ev = self.events.get(timeout=timeout)
            if ev.terminal:
                self.end = ev
            else:
                self.messages.append(ev.message)
        return self.end


def compile_inferlet(host: Host, name_or_path: str | Path) -> str:
    """Build (cached) and compile a standard inferlet, a source folder or a .wasm; returns its hash."""
    return host.compile(resolve_inferlet(name_or_path, quiet=True).read_bytes())
