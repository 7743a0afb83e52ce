"""The scripted FakeHost the server tests run on (tests/server_support.py) behaves like a host."""

from __future__ import annotations

import queue

from helpers import wait_for
from server_support import WASM, FakeHost

from host.events import InstanceEvent


def test_fake_host_frees_pages() -> None:
    host = FakeHost(total_pages=8)
    h = host.compile(WASM)
    events: list[InstanceEvent] = []
    host.launch(h, ["echo", "a"], events.append)
    wait_for(lambda: len(events) == 2)
    assert [e.event for e in events] == ["message", "completed"]
    assert host.free_pages() == 8


def test_gated_script_waits_for_its_gate_and_terminate_ends_it() -> None:
    host = FakeHost(total_pages=8)
    h = host.compile(WASM)
    events: queue.Queue[InstanceEvent] = queue.Queue()
    gated = host.launch(h, ["gated", "go", "x"], events.put)
    stuck = host.launch(h, ["gated", "never"], events.put)
    assert events.empty()
    host.open_gate("go")
    first = events.get(timeout=5)
    assert (first.instance_id, first.event, first.message) == (gated, "message", "x")
    assert events.get(timeout=5).event == "completed"
    host.terminate(stuck, "bye")
    end = events.get(timeout=5)
    assert (end.instance_id, end.event, end.message) == (stuck, "aborted", "bye")
    wait_for(lambda: host.free_pages() == 8)
