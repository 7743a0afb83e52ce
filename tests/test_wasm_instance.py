"""host/wasm: an instance runs, ends and is stopped with only its `InstanceEnv` (no `Host`)."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import wasmtime
from wasmtime.component import Linker

from host.batching.gate import RunGate
from host.events import InstanceEvent
from host.wasm.calling import calling
from host.wasm.engine import CompileError, WasmEngine
from host.wasm.instance import Instance, InstanceEnv, current
from host.wasm.limits import InstanceLimits
from host.wasm.traps import split_wasmtime_error

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WasmEngine]:
    e = WasmEngine(tmp_path_factory.mktemp("cache"), tick_ms=5)
    yield e
    e.stop()


def run(engine: WasmEngine, fixture: str, limits: InstanceLimits,
        imports: dict[str, dict[str, Callable[..., object]]] | None = None,
        on_end: Callable[[Instance], None] | None = None) -> tuple[Instance, queue.Queue, list]:
    """Start an instance of `fixture` (a fixture name, or component WAT text) with these host imports."""
    wat = fixture if fixture.lstrip().startswith("(") else (FIXTURES / f"{fixture}.wat").read_text()
    program = engine.compile(bytes(wasmtime.wat2wasm(wat)))
    linker = Linker(engine.engine)
    linker.add_wasip2()
    with linker.root() as root:
        for iface, funcs in (imports or {}).items():
            with root.add_instance(iface) as li:
                for name, fn in funcs.items():
                    li.add_func(name, fn)
    ended: list[Instance] = []
    blocked: list[str] = []
    env = InstanceEnv(engine=engine, linker=linker, gate=RunGate(), limits=limits,
                      on_block=blocked.append, on_end=lambda i: (ended.append(i), on_end and on_end(i)))
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


# ---- limits: memories, tables and instances together stay under the cap (issue 11, item 3) ----

@pytest.mark.parametrize("limits", [InstanceLimits(), InstanceLimits(memory_bytes=48 * 2**20),
                                    InstanceLimits(memory_bytes=2**20), InstanceLimits(max_memories=3, max_tables=9)])
def test_store_limits_add_up_to_at_most_the_cap(limits: InstanceLimits) -> None:
    s = limits.store_limits
    assert s.total_bytes <= limits.memory_bytes
    assert (s.memories, s.tables, s.instances) == (limits.max_memories, limits.max_tables, limits.max_instances)
    assert s.memory_size >= limits.memory_bytes // limits.max_memories - limits.memory_bytes // 8


def test_limits_too_small_for_one_page_per_memory_are_refused() -> None:
    with pytest.raises(ValueError, match="less than one 64 KiB page"):
        InstanceLimits(memory_bytes=2**20, max_memories=32)
    with pytest.raises(ValueError, match="max_tables must be at least 1"):
        InstanceLimits(max_tables=0)


def component(core: str) -> str:
    """A component around one core module with the items `core` (which must export "mem") and a `run`."""
    return f"""(component
      (core module $m {core}
        (func (export "run") (result i32) i32.const 0))
      (core instance $i (instantiate $m))
      (func (export "run") (result (result (error string)))
        (canon lift (core func $i "run") (memory (core memory $i "mem")))))"""


def many_instances(n: int) -> str:
    insts = "\n".join("(core instance (instantiate $e))" for _ in range(n))
    return f"""(component (core module $e) {insts}
      (core module $m (memory (export "mem") 1) (func (export "run") (result i32) i32.const 0))
      (core instance $i (instantiate $m))
      (func (export "run") (result (result (error string)))
        (canon lift (core func $i "run") (memory (core memory $i "mem")))))"""


LIMIT_CASES = {
    "memory": (component('(memory (export "mem") 800)'), "memory limit exceeded: a linear memory starts at "
                                                         "50.0 MiB (800 pages), the limit is 46.0 MiB per linear memory"),
    "table elements": (component('(memory (export "mem") 1) (table 100000 funcref)'),
                       "table elements limit exceeded: a table starts at 100000 elements, the limit is 65536 "
                       "elements per table"),
    "tables": (component('(memory (export "mem") 1) (table 1 funcref) (table 1 funcref) (table 1 funcref) '
                         '(table 1 funcref) (table 1 funcref)'),
               "tables limit exceeded: the component creates at least 5 tables, the limit is 4"),
    "instances": (many_instances(40), "instances limit exceeded: the component creates at least 33 core wasm "
                                      "instances, the limit is 32"),
}


@pytest.mark.parametrize("case", sorted(LIMIT_CASES))
def test_instantiation_past_a_limit_names_it(engine: WasmEngine, case: str) -> None:
    wat, message = LIMIT_CASES[case]
    _, events, ended = run(engine, wat, InstanceLimits(memory_bytes=48 * 2**20))
    ev = events.get(timeout=30)
    assert (ev.event, ev.message) == ("exception", message)


# ---- the budget holds while the guest is blocked in an import (item 4) ----

def test_wall_budget_ends_a_guest_blocked_in_an_import(engine: WasmEngine) -> None:
    def receive(_store: object, _timeout: int | None) -> str | None:
        current().wait_until(lambda: False)  # nothing ever arrives
        return None

    t0 = time.perf_counter()
    inst, events, ended = run(engine, "blocked_receive", InstanceLimits(wall_budget_s=0.3),
                              {"pie:inferlet/messaging@0.1.0": {"receive": receive}})
    ev = events.get(timeout=10)
    assert (ev.event, ev.message) == ("exception", "wall-clock budget of 0.3 s exceeded")
    assert time.perf_counter() - t0 < 1.3 and ended == [inst]


def test_wait_until_returns_false_at_its_own_timeout_within_the_budget(engine: WasmEngine) -> None:
    waited: list[bool] = []

    def receive(_store: object, _timeout: int | None) -> str | None:
        waited.append(current().wait_until(lambda: False, 0.05))
        return None

    _, events, _ = run(engine, "blocked_receive", InstanceLimits(wall_budget_s=10),
                       {"pie:inferlet/messaging@0.1.0": {"receive": receive}})
    assert events.get(timeout=10).event == "completed" and waited == [False]


def test_an_instance_leaves_nothing_on_its_thread_for_the_next(engine: WasmEngine) -> None:
    """Threads run one instance after another (host/wasm/threads.py): an exception a host function
    left on the thread, or the instance itself, must not be there for the next instance (another
    tenant's) to see as its own."""
    def receive(_store: object, _timeout: int | None) -> str | None:
        calling.exception = RuntimeError("this instance's failure")  # (as fastcall keeps one until raised)
        return None

    left: list[dict[str, object]] = []
    _, events, ended = run(engine, "blocked_receive", InstanceLimits(),
                           {"pie:inferlet/messaging@0.1.0": {"receive": receive}},
                           on_end=lambda _inst: left.append(dict(calling.__dict__)))  # (on its thread, at its end)
    assert events.get(timeout=10).terminal and len(ended) == 1
    assert left == [{}]


# ---- trap messages: wasmtime's cause first (item 6) ----

def test_trap_message_keeps_wasmtimes_cause_first(engine: WasmEngine) -> None:
    _, events, _ = run(engine, "bad_list", InstanceLimits(memory_bytes=48 * 2**20),
                       {"pie:inferlet/kv@0.1.0": {"release": lambda _store, _pages: None}})
    first, *rest = events.get(timeout=10).message.splitlines()
    assert first == "trap: list pointer/length out of bounds of memory"
    assert rest[0] == "wasm backtrace:" and "limit" not in first


def testsplit_wasmtime_error() -> None:
    text = ("error while executing at wasm backtrace:\n" + "".join(f"    {i}: 0x1 - m!f{i}\n" for i in range(10))
            + "\nCaused by:\n    0: outer context\n    1: invalid utf-8 sequence")
    cause, frames = split_wasmtime_error(text)
    assert cause == "outer context: invalid utf-8 sequence"
    assert frames.splitlines()[0] == "  0: 0x1 - m!f0" and frames.splitlines()[-1] == "  ... 2 more frames"
    assert split_wasmtime_error("resource limit exceeded: memory count too high at 2\n") == \
        ("resource limit exceeded: memory count too high at 2", "")
    assert split_wasmtime_error("failed to call `run`\n\nCaused by:\n    bad thing") == ("failed to call `run`: bad thing", "")
