"""Shared by the examples: an embedded host on the default model and a way to run an inferlet on it."""

from __future__ import annotations

import json
import queue
from collections.abc import Callable

from host import Host, HostConfig
from host.cli.build import resolve_inferlet
from host.events import TERMINAL_EVENTS, InstanceEvent


def make_host() -> Host:
    """An embedded host with the default model (SmolLM2-135M-Instruct) on GPU if there is one, else CPU."""
    return Host(HostConfig())


def launch(host: Host, name: str, args: list[str], on_message: Callable[[str, str], None] | None = None,
           close_input: bool = True) -> tuple[str, queue.Queue[InstanceEvent]]:
    """Build (cached) and start a standard inferlet; `on_message(instance_id, text)` sees its messages."""
    prog = host.compile(resolve_inferlet(name, quiet=True).read_bytes())
    events: queue.Queue[InstanceEvent] = queue.Queue()

    def cb(ev: InstanceEvent) -> None:
        if ev.event == "message" and on_message is not None:
            on_message(ev.instance_id, ev.message)
        events.put(ev)

    iid = host.launch(prog, args, cb)
    if close_input:
        host.close_input(iid)
    return iid, events


def finish(events: queue.Queue[InstanceEvent], timeout: float = 600.0) -> str:
    """Wait for the instance's end; its return value, or SystemExit with the reason."""
    while True:
        ev = events.get(timeout=timeout)
        if ev.event in TERMINAL_EVENTS:
            if ev.event != "completed":
                raise SystemExit(f"{ev.event}: {ev.message}")
            return ev.message


def run(host: Host, name: str, args: list[str]) -> str:
    return finish(launch(host, name, args)[1])


def show(title: str, value: str) -> None:
    try:
        value = json.dumps(json.loads(value), indent=2)
    except ValueError:
        pass
    print(f"== {title}\n{value}\n")
