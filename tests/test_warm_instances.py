"""Warm instances (host/wasm/warm.py), the pooling allocator (host/wasm/pooling.py) and max_instances.

A warm instance is started before its launch and waits at its first host call; to its guest and
its client it must be indistinguishable from a cold start. Runs on the fake backend (the token
after t is t+1), so the expected outputs are known without the code under test.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime
from fakes import FakeBackend
from helpers import Run, text_completion_burst, wait_for, wasm_bytes

from host import Host, HostBusy, HostConfig
from host.wasm.engine import WasmEngine
from host.wasm.instance import Instance
from host.wasm.limits import InstanceLimits
from host.wasm.pooling import PoolingConfig


def expected(prompt: list[int], n: int) -> str:
    return " ".join(str(prompt[-1] + 1 + i) for i in range(n))


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    cfg = HostConfig(warm_instances=2, wall_budget_s=1.0, max_instances=3, launch_queue=1,
                     data_dir=tmp_path_factory.mktemp("d"))
    h = Host(cfg, backend=FakeBackend(page_size=4, num_pages=256, delay_s=0.002))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def misbehave(host: Host) -> str:
    return host.compile(wasm_bytes("misbehave"))


def test_a_warm_launch_gives_the_cold_output_and_the_pool_refills(host: Host, misbehave: str) -> None:
    assert host.prewarm(misbehave, 2) == 2
    warm_ids = {i.id for q in host.warm._ready.values() for i in q}
    assert host.instances() == []  # parked instances are nobody's yet
    before = host.stats()["warm_pool"]
    assert before["parked"] == 2
    prompt = [3, 4, 5]
    run = Run(host, misbehave, ["generate", "6", *map(str, prompt)], tenant="alice")
    assert run.id in warm_ids
    end = run.finish(60)
    assert (end.event, end.message) == ("completed", expected(prompt, 6))
    wait_for(lambda: host.warm.ready_count(misbehave) == 2, what="the pool to refill")
    parked = list(host.warm._ready[misbehave])
    assert host.prewarm(misbehave, 0) == 0  # stop keeping it warm: the parked ones are stopped
    assert host.warm.ready_count(misbehave) == 0
    wait_for(lambda: all(i.finished.is_set() for i in parked), what="the parked instances to end")
    assert Run(host, misbehave, ["generate", "2", "7"]).finish(60).event == "completed"  # none parked: cold
    after = host.stats()["warm_pool"]  # (stats and /metrics: how launches started)
    assert (after["launches_warm"] - before["launches_warm"], after["launches_cold"] - before["launches_cold"]) \
        == (1, 1)
    assert after["parked"] == 0


def test_the_wall_budget_starts_at_launch_not_when_warmed(host: Host, misbehave: str) -> None:
    assert host.prewarm(misbehave, 2) == 2
    time.sleep(1.2)  # longer than the 1 s budget: a budget counted from the warm start would be spent
    end = Run(host, misbehave, ["generate", "4", "7"]).finish(60)
    assert (end.event, end.message) == ("completed", expected([7], 4))
    spin = Run(host, misbehave, ["loop"]).finish(60)  # ... and it still holds after launch
    assert spin.event == "exception" and "wall-clock budget of 1 s exceeded" in spin.message



def _hold_gate(gate, n: int) -> tuple[list, threading.Event]:
    """Threads that take `n` run-gate slots and keep them until the event is set."""
    release = threading.Event()
    holding = threading.Barrier(n + 1)

    def hold() -> None:
        gate.enter()
        holding.wait(5)
        release.wait(30)
        gate.leave()

    threads = [threading.Thread(target=hold) for _ in range(n)]
    for t in threads:
        t.start()
    holding.wait(5)
    return threads, release


def test_a_warm_launch_waits_for_its_turn_at_the_run_gate(host: Host, misbehave: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A launched warm instance is woken when a gate slot is free (like an instance whose forward is
    done), not at once only to queue for one; ended before its turn, it gives the turn back."""
    assert host.prewarm(misbehave, 2) == 2
    monkeypatch.setattr(host.gate, "max_hold_s", 30.0)  # the holders below are not "stuck"
    threads, release = _hold_gate(host.gate, host.gate.slots)
    try:
        waiting = Run(host, misbehave, ["generate", "3", "5"])
        stopped = Run(host, misbehave, ["generate", "3", "5"])
        time.sleep(0.2)
        insts = host._instances
        assert insts[waiting.id].state == "warm" and insts[stopped.id].state == "warm"  # not resumed
        assert len(host.gate._waiters) == 0 and len(host.gate._pending) == 2  # queued, not woken
        host.terminate(stopped.id)
        assert stopped.finish(30).event == "aborted"
    finally:
        release.set()
        for t in threads:
            t.join(10)
    end = waiting.finish(60)
    assert (end.event, end.message) == ("completed", expected([5], 3))
    wait_for(lambda: host.gate._held == 0 and host.gate._handing == 0, what="the gate to be free")


def test_launches_past_max_instances_queue_then_a_full_queue_is_a_clear_error(host: Host, misbehave: str) -> None:
    hogs = [Run(host, misbehave, ["hog", "1"]) for _ in range(3)]
    for h in hogs:
        assert h.events.get(timeout=60).message == "holding"
    queued = Run(host, misbehave, ["generate", "1", "1"])  # the launch queue holds one (launch_queue=1)
    assert [i["state"] for i in host.instances() if i["id"] == queued.id] == ["queued"]
    assert host.stats()["launch_queue"]["queued"] == 1
    with pytest.raises(HostBusy, match="maximum of 3 instances and 1 launches wait"):
        host.launch(misbehave, ["ok"])
    time.sleep(0.2)
    assert queued.events.empty()  # no slot yet
    host.signal(hogs[0].id, "go")  # its slot goes to the queued launch
    assert hogs[0].finish(60).message == "released"
    assert queued.finish(60).message == "2"
    for h in hogs[1:]:
        host.signal(h.id, "go")
        assert h.finish(60).message == "released"
    assert Run(host, misbehave, ["generate", "1", "1"]).finish(60).message == "2"


def test_a_queued_launch_ends_when_terminated_or_past_its_timeout(tmp_path: Path) -> None:
    h = Host(HostConfig(max_instances=1, launch_queue=4, launch_queue_timeout_s=1.0, warm_auto=0, data_dir=tmp_path),
             backend=FakeBackend(page_size=4, num_pages=64))
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        hog = Run(h, prog, ["hog", "1"])
        assert hog.events.get(timeout=60).message == "holding"
        stopped, late = Run(h, prog, ["ok"]), Run(h, prog, ["ok"])
        h.terminate(stopped.id, "not wanted")
        assert (stopped.finish(30).event, stopped.end.message) == ("aborted", "not wanted")
        end = late.finish(30)
        assert end.event == "out_of_resources" and "waited 1 s in the launch queue" in end.message
        assert h.stats()["launch_queue"]["timeouts"] == 1
        h.signal(hog.id, "go")
        assert hog.finish(60).message == "released"
    finally:
        h.shutdown()


@pytest.mark.parametrize("fixture,cold_end", [("loop", "exception"), ("echo", "completed")])
def test_a_program_that_never_reaches_a_host_call_is_not_warmed(
        host: Host, fixture: str, cold_end: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Instance, "WARM_DEADLINE_S", 0.2)
    program = host.compile(wasm_bytes(fixture))
    assert host.prewarm(program, 1, timeout_s=30) == 0
    assert program in host.warm._cold
    end = Run(host, program, []).finish(60)  # launches start cold and end as they always did
    assert end.event == cold_end


def test_shutdown_stops_the_parked_instances(tmp_path) -> None:
    h = Host(HostConfig(warm_instances=3, data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=64))
    program = h.compile(wasm_bytes("misbehave"))
    assert h.prewarm(program, 3) == 3
    parked = [i for q in h.warm._ready.values() for i in q]
    h.shutdown()
    assert all(i.finished.is_set() for i in parked)
    assert h.free_pages() == 64


def test_a_full_instance_pool_is_refused_with_a_message_naming_it(tmp_path) -> None:
    pool = PoolingConfig(slots=1, limits=InstanceLimits())
    engine = WasmEngine(tmp_path, tick_ms=5, pooling=pool)
    try:
        component = engine.get(engine.compile(wasm_bytes("echo")))
        linker = wasmtime.component.Linker(engine.engine)
        first = wasmtime.Store(engine.engine)
        linker.instantiate(first, component)  # takes the only slot while `first` lives
        with pytest.raises(wasmtime.WasmtimeError) as err:
            linker.instantiate(wasmtime.Store(engine.engine), component)
        assert pool.explain(str(err.value)) == (
            "the host's instance pool is full (1 instances at once); wait for instances to end, "
            "or start the host with a larger --max-instances")
        assert pool.explain("some other trap") is None
    finally:
        engine.stop()


def test_a_limited_address_space_falls_back_to_on_demand_allocation(tmp_path) -> None:
    """wasmtime aborts the process when it cannot reserve the pool; under `ulimit -v` the host
    must not try, and instances still run."""
    script = f"""
import resource, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).parent)!r})
resource.setrlimit(resource.RLIMIT_AS, (24 << 30, resource.RLIM_INFINITY))
from fakes import FakeBackend
from helpers import Run, wasm_bytes
from host import Host, HostConfig
h = Host(HostConfig(data_dir=Path({str(tmp_path)!r})), backend=FakeBackend(page_size=4, num_pages=16))
assert h.wasm.pooling is None
print(Run(h, h.compile(wasm_bytes("echo")), []).finish(60).event)
h.shutdown()
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "completed"


def _vm_size_kib() -> int:
    return int(Path("/proc/self/status").read_text().split("VmSize:")[1].split()[0])


@pytest.mark.heavy  # (~2-9 s; make test runs it)
def test_shutdown_gives_the_pool_address_space_back(tmp_path) -> None:
    """Each pooled engine reserves ~1 TiB of address space; hosts that were shut down must not
    keep theirs (after ~90 of them a process would run out, and wasmtime aborts then)."""
    sizes = []
    for _ in range(4):
        h = Host(HostConfig(data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=16))
        assert h.wasm.pooling is not None
        h.shutdown()
        sizes.append(_vm_size_kib())
    assert sizes[-1] - sizes[0] < 64 * 2**20  # KiB: well under one pool's reservation


# ---- issue 40: the model's constants are answered while an instance warms ----

def test_a_before_launch_import_answers_a_parked_instance_and_another_import_parks_it() -> None:
    from types import SimpleNamespace

    from host.api.guest import guest_import
    from host.wasm.calling import calling

    seen: list[object] = []
    parked = SimpleNamespace(parked=True, stepper=None, await_launch=lambda: seen.append("parked"))

    @guest_import("model.constant", before_launch=True)
    def constant(inst: object) -> int:
        seen.append(inst)
        return 7

    @guest_import("runtime.launch-specific")
    def specific(inst: object) -> int:
        seen.append(inst)
        return 8

    calling.instance = parked
    try:
        assert constant(None) == 7 and seen == [parked]  # answered, not parked
        assert specific(None) == 8 and seen == [parked, "parked", parked]  # parked first, then answered
    finally:
        calling.instance = None


@pytest.mark.build
def test_a_warm_text_completion_asked_for_the_model_constants_before_it_parked(tmp_path: Path) -> None:
    """The SDK asks for the stop tokens and the chat template before its arguments; the host answers
    them while the instance warms, so it parks at `runtime.arguments` and its launch is exact."""
    import host.api.model as model_api
    from host.wasm.calling import calling

    fb = FakeBackend(page_size=16, num_pages=256)
    calls: list[tuple[str, bool]] = []
    real_imports = model_api.imports

    def counting_imports(*args: object, **kwargs: object) -> object:
        table = real_imports(*args, **kwargs)
        for name in ("stop-tokens", "chat-template"):
            fn = table[name]

            def wrapped(store: object, *a: object, _fn: object = fn, _name: str = name) -> object:
                inst = getattr(calling, "instance", None)
                calls.append((_name, bool(inst is not None and inst.parked)))
                return _fn(store, *a)  # type: ignore[operator]

            table[name] = wrapped
        return table

    model_api.imports = counting_imports  # type: ignore[assignment]
    try:
        h = Host(HostConfig(data_dir=tmp_path, warm_auto=0), backend=fb)
    finally:
        model_api.imports = real_imports  # type: ignore[assignment]
    try:
        prog = h.compile(wasm_bytes("text_completion"))
        assert h.prewarm(prog, 1) == 1
        assert sorted(calls) == [("chat-template", True), ("stop-tokens", True)]  # asked while parked-to-be
        tok = fb.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi there"}], True))
        run = Run(h, prog, ["--prompt", "hi there", "--max-tokens", "8"])
        want = tok.decode([(ids[-1] + 1 + j) % 256 for j in range(8)])
        assert (run.finish(60).event, run.end.message) == ("completed", want)  # type: ignore[union-attr]
        assert len(calls) == 2  # the launched instance did not ask again
    finally:
        h.shutdown()


@pytest.fixture()
def fresh(tmp_path: Path) -> Iterator[Host]:
    h = Host(HostConfig(warm_auto=0, data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=64))
    yield h
    h.shutdown()


@pytest.fixture
def fresh_inproc(tmp_path: Path) -> Iterator[Host]:
    """`fresh` with its guests in this process (workers=0): for tests that patch how a store is
    made or watched here (a worker makes its own, in its process)."""
    h = Host(HostConfig(warm_auto=0, data_dir=tmp_path, workers=0), backend=FakeBackend(page_size=4, num_pages=64))
    yield h
    h.shutdown()


def _slow_start(monkeypatch: pytest.MonkeyPatch, seconds: float) -> threading.Event:
    """Warm starts wait `seconds` while the returned event is set (it is, until the test clears it),
    without CPU, after the store's epoch deadline is set: as a thread at the lowest priority waits
    for a core while a burst runs (the deadline is then long past when its guest runs)."""
    import host.wasm.instance as instance_module

    watch = instance_module.watch_epochs

    def slow_watch(store: wasmtime.Store, owner: Instance) -> int:
        key = watch(store, owner)
        if slow.is_set():
            time.sleep(seconds)
        return key

    slow = threading.Event()
    slow.set()
    monkeypatch.setattr(instance_module, "watch_epochs", slow_watch)
    return slow


def test_a_warm_start_slowed_by_a_busy_cpu_still_warms(fresh: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warm deadline counts the instance's CPU time: a start that waited for a core (wall time)
    is no guest computing before its first call. Counted in wall time, a burst of 256 on 2 vCPUs
    made a standard inferlet's warm start miss it, and the program was never warmed again."""
    monkeypatch.setattr(Instance, "WARM_DEADLINE_S", 0.2)
    _slow_start(monkeypatch, 0.6)
    program = fresh.compile(wasm_bytes("misbehave"))
    assert fresh.prewarm(program, 1, timeout_s=30) == 1
    assert program not in fresh.warm._cold
    assert Run(fresh, program, ["ok"]).finish(60).event == "completed"


def test_a_warm_start_given_up_is_tried_again(fresh_inproc: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    import host.wasm.warm as warm_module

    monkeypatch.setattr(warm_module, "_START_TIMEOUT_S", 0.1)
    slow = _slow_start(monkeypatch, 0.5)
    program = fresh_inproc.compile(wasm_bytes("misbehave"))
    assert fresh_inproc.prewarm(program, 1, timeout_s=1.0) == 0  # each start given up after 0.1 s
    assert program not in fresh_inproc.warm._cold
    slow.clear()
    assert fresh_inproc.prewarm(program, 1, timeout_s=30) == 1


def test_a_warm_start_that_failed_in_the_host_is_tried_again(fresh_inproc: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    new_store = WasmEngine.new_store
    failures = [1]

    def failing(self: WasmEngine) -> wasmtime.Store:
        if failures:
            failures.pop()
            raise RuntimeError("no store for now")
        return new_store(self)

    monkeypatch.setattr(WasmEngine, "new_store", failing)
    program = fresh_inproc.compile(wasm_bytes("misbehave"))
    assert fresh_inproc.prewarm(program, 1, timeout_s=30) == 1
    assert not failures and program not in fresh_inproc.warm._cold


def test_warm_starts_failing_in_the_host_are_retried_at_a_pace(fresh_inproc: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    tries: list[float] = []

    def failing(self: WasmEngine) -> wasmtime.Store:
        if self is fresh_inproc.wasm:  # (only this host's tries: another host's in this process may start one)
            tries.append(time.monotonic())
        raise RuntimeError("no store for now")

    monkeypatch.setattr(WasmEngine, "new_store", failing)
    program = fresh_inproc.compile(wasm_bytes("misbehave"))
    assert fresh_inproc.prewarm(program, 1, timeout_s=1.2) == 0
    assert 1 <= len(tries) <= 4 and program not in fresh_inproc.warm._cold


@pytest.mark.build
def test_a_starved_warm_text_completion_still_warms_and_answers(fresh: Host, monkeypatch: pytest.MonkeyPatch) -> None:
    """The standard inferlet through the same starved start: warmed, then exact at its launch."""
    monkeypatch.setattr(Instance, "WARM_DEADLINE_S", 0.2)
    slow = _slow_start(monkeypatch, 0.6)
    program = fresh.compile(wasm_bytes("text_completion"))
    assert fresh.prewarm(program, 2, timeout_s=60) == 2 and program not in fresh.warm._cold
    slow.clear()
    got, wants = text_completion_burst(fresh, program, ["hi there", "a lighthouse"], 8)
    assert got == wants
