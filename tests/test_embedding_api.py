"""The public embedding API: `from host import Host, HostConfig`, any `Backend` implementation."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import wasmtime
from fakes import FakeBackend

from gpu_backend.standin import StandInBackend
from host import Backend, CompileError, Host, HostConfig, InstanceEvent

FIXTURES = Path(__file__).parent / "fixtures"


def wat(name: str) -> bytes:
    return bytes(wasmtime.wat2wasm((FIXTURES / f"{name}.wat").read_text()))


def test_every_backend_implements_the_protocol() -> None:
    from inferlet.testing import TinyBackend

    for b in (FakeBackend(), StandInBackend(), TinyBackend()):
        assert isinstance(b, Backend), type(b).__name__
    assert not isinstance(object(), Backend)


def test_real_backend_implements_the_protocol(backend) -> None:  # noqa: ANN001
    assert isinstance(backend, Backend)


def test_host_lifecycle_through_the_public_api(tmp_path) -> None:  # noqa: ANN001
    with Host(HostConfig(data_dir=tmp_path), backend=StandInBackend(num_pages=32)) as host:
        assert host.free_pages() == 32
        with pytest.raises(CompileError):
            host.compile(b"not wasm")
        program = host.compile(wat("echo"))
        assert host.has_program(program)
        events: queue.Queue[InstanceEvent] = queue.Queue()
        iid = host.launch(program, ["x"], events.put)
        assert host.wait(iid, timeout=30)
        assert events.get(timeout=5).event == "completed"
        spin = host.launch(host.compile(wat("loop")), [], events.put)
        host.terminate(spin, "bye")
        assert host.wait(spin, timeout=30)
        ev = events.get(timeout=5)
        assert (ev.instance_id, ev.event, ev.message) == (spin, "aborted", "bye")
        with pytest.raises(KeyError):
            host.signal(spin, "too late")
        assert host.instances() == [] and host.free_pages() == 32
    with pytest.raises(RuntimeError, match="shut down"):
        host.launch(program, [])
