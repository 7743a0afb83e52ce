"""host/wasm: an instance runs, ends and is stopped with only its `InstanceEnv` (no `Host`)."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime
from wasmtime.component import Linker

from host.batching.gate import RunGate
from host.events import InstanceEvent
from host.wasm.engine import CompileError, WasmEngine
from host.wasm.instance import Instance, InstanceEnv
from host.wasm.limits import InstanceLimits

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WasmEngine]:
    e = WasmEngine(tmp_path_factory.mktemp("cache"), tick_ms=5)
    yield e
    e.stop()


def run(engine: WasmEngine, fixture: str, limits: InstanceLimits) -> tuple[Instance, queue.Queue, list]:
    program = engine.compile(bytes(wasmtime.wat2wasm((FIXTURES / f"{fixture}.wat").read_text())))
    linker = Linker(engine.engine)
    linker.add_wasip2()
    ended: list[Instance] = []
    blocked: list[str] = []
    env = InstanceEnv(engine=engine, linker=linker, gate=RunGate(), limits=limits,
                      on_block=blocked.append, on_end=ended.append)
    events: queue.Queue[InstanceEvent] = queue.Queue()
    inst = Instance(env, program, ["a"], events.put)
    inst.start()
    return inst, events, ended


def test_completes_and_reports_its_end(engine: WasmEngine) -> None:
    inst, events, ended = run(engine, "echo", InstanceLimits())
    ev = events.get(timeout=30)
    assert ev.event == "completed" and ev.terminal and ev.instance_id == inst.id
    assert ended == [inst] and inst.join(5)


def test_wall_budget_traps_a_spinning_guest(engine: WasmEngine) -> None:
    inst, events, _ = run(engine, "loop", InstanceLimits(wall_budget_s=0.2))
    ev = events.get(timeout=30)
    assert ev.event == "exception" and "wall-clock budget of 0.2 s exceeded" in ev.message


def test_terminate_stops_a_spinning_guest(engine: WasmEngine) -> None:
    inst, events, ended = run(engine, "loop", InstanceLimits())
    inst.terminate("enough")
    ev = events.get(timeout=30)
    assert (ev.event, ev.message) == ("aborted", "enough") and ended == [inst]


def test_compile_rejects_garbage_with_the_reason(engine: WasmEngine) -> None:
    with pytest.raises(CompileError):
        engine.compile(b"\0asm garbage")
    with pytest.raises(KeyError, match="unknown program"):
        engine.get("0" * 64)
