"""Background warming (HostConfig.warm_yield, host/wasm/priority.py): the warm pool refills and the
reaper frees while instances run, a warm instance's thread runs at the lowest CPU priority only
until its launch, and `Host.warm_start` readies a fresh host's pools. About guests in this process:
every host here pins workers=0 (with workers, the stores, slots and reaper are the workers' own)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import FakeBackend
from helpers import Run, text_completion_burst, wait_for, wasm_bytes

from host import Host, HostConfig
from host.wasm import priority
from host.wasm.reaper import StoreReaper

needs_nice = pytest.mark.skipif(not priority.available(), reason="a lowered thread cannot be raised back here")


def make_host(tmp_path: Path, **config: object) -> Host:
    config.setdefault("workers", 0)
    cfg = HostConfig(max_instances=8, warm_auto=4, data_dir=tmp_path, **config)  # type: ignore[arg-type]
    return Host(cfg, backend=FakeBackend(page_size=4, num_pages=256))


@pytest.fixture(scope="module")
def misbehave_wasm() -> bytes:
    return wasm_bytes("misbehave")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = make_host(tmp_path)
    yield h
    h.shutdown()


def holding(host: Host, program: str) -> Run:
    """An instance of misbehave that holds a page until it gets a message (it has said so)."""
    run = Run(host, program, ["hog", "1"])
    assert run.events.get(timeout=30).message == "holding"
    return run


def nice_of(inst: object) -> int:
    return os.getpriority(os.PRIO_PROCESS, inst._job.native_id)  # type: ignore[attr-defined]


@needs_nice
def test_the_pool_refills_while_an_instance_runs(host: Host, misbehave_wasm: bytes) -> None:
    """A host that never goes idle still gets its pool back: refills run beside running instances."""
    program = host.compile(misbehave_wasm)
    held = holding(host, program)
    host.warm.seed(program, 2)
    wait_for(lambda: host.warm.ready_count(program) == 2, what="the pool to refill while busy")
    assert [i["id"] for i in host.instances()] == [held.id]  # still running: the refill did not wait for idle
    host.signal(held.id, "go")
    assert held.finish(30).message == "released"


def test_without_warm_yield_the_pool_waits_for_an_idle_host(tmp_path: Path, misbehave_wasm: bytes) -> None:
    h = make_host(tmp_path, warm_yield=False)
    try:
        program = h.compile(misbehave_wasm)
        held = holding(h, program)
        h.warm.seed(program, 2)
        assert h.warm.wait_ready(program, 1, 0.5) == 0  # busy: nothing warmed
        h.signal(held.id, "go")
        assert held.finish(30).message == "released"
        assert h.warm.wait_ready(program, 2, 30) == 2  # idle again: refilled
    finally:
        h.shutdown()


@needs_nice
def test_a_warm_instance_runs_in_the_background_until_its_launch(host: Host, misbehave_wasm: bytes) -> None:
    program = host.compile(misbehave_wasm)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert host.prewarm(program, 1) == 1
    parked = host.warm._ready[program][0]
    assert nice_of(parked) == max(base, priority.BACKGROUND_NICE)
    run = holding(host, program)
    assert run.id == parked.id
    assert nice_of(parked) == base  # it serves a client now: back at the host's priority
    host.signal(run.id, "go")
    assert run.finish(30).message == "released"


def test_warm_start_readies_the_pools_of_a_fresh_host(host: Host, misbehave_wasm: bytes) -> None:
    [program] = host.warm_start([misbehave_wasm], per_program=3)
    assert host.warm.ready_count(program) == 3
    warm_ids = {i.id for i in host.warm._ready[program]}
    run = Run(host, program, ["generate", "3", "5"])
    assert run.id in warm_ids
    assert (run.finish(30).event, run.end.message) == ("completed", "6 7 8")  # type: ignore[union-attr]
    wait_for(lambda: host.warm.ready_count(program) == 3, what="the pool to refill after the launch")


def test_warm_start_returns_once_the_primed_slots_are_reset(host: Host, misbehave_wasm: bytes) -> None:
    """Priming's purpose is each slot's first reset before the first burst: those resets are the
    frees of the primed stores, so warm_start waits for the reaper to finish them."""
    reaper = host.wasm.reaper
    assert reaper is not None
    resets: list[float] = []
    free = reaper._free

    def slow_free(store: object) -> None:  # a first reset takes ~25 ms of faults on a real slot
        time.sleep(0.02)
        free(store)
        resets.append(time.monotonic())

    reaper._free = slow_free  # type: ignore[method-assign]
    [program] = host.warm_start([misbehave_wasm], per_program=3)
    returned = time.monotonic()
    assert reaper.pending() == 0 and len(resets) >= 6  # 2 x 3 primed, all reset before it returned
    assert max(resets) <= returned
    assert host.warm.ready_count(program) == 3


def test_warm_start_shares_warm_auto_between_programs(host: Host, misbehave_wasm: bytes) -> None:
    blocked = wasm_bytes("blocked_receive")  # parks at its first host call, like any inferlet
    programs = host.warm_start([misbehave_wasm, blocked], timeout_s=30)
    assert [host.warm.ready_count(p) for p in programs] == [2, 2]  # warm_auto=4 over two programs


def test_a_background_reaper_frees_at_once_while_the_backend_is_busy() -> None:
    class Store:
        closed = False

        def close(self) -> None:
            self.closed = True

    reaper = StoreReaper(lambda: True, max_delay_s=30.0, background=True)
    try:
        store = Store()
        reaper.put(store)
        wait_for(lambda: store.closed, timeout=5, what="the store to be freed")
        assert reaper.freed_inline == 0  # by the reaper's thread, not the caller
    finally:
        reaper.close()


# ---- issue 40: refills and frees wait while launched instances start ----

def test_a_launched_instance_counts_as_starting_until_it_first_waits(host: Host, misbehave_wasm: bytes) -> None:
    program = host.compile(misbehave_wasm)
    assert not host.starts.active()
    spinning = Run(host, program, ["loop"])  # computes without a host call: starting until it ends
    wait_for(lambda: host.starts.active(), what="the launch to count as starting")
    held = holding(host, program)  # waits for a client message once it holds its page
    host.terminate(spinning.id)
    spinning.finish(30)
    wait_for(lambda: not host.starts.active(), what="the waiting and the ended instance to be done starting")
    host.signal(held.id, "go")
    assert held.finish(30).message == "released"


@needs_nice  # (without background refills the pool waits for an idle host anyway)
def test_a_refill_waits_for_starting_instances_but_not_for_ever(host: Host, misbehave_wasm: bytes) -> None:
    program = host.compile(misbehave_wasm)
    spinning = Run(host, program, ["loop"])
    wait_for(lambda: host.starts.active(), what="the launch to count as starting")
    time.sleep(0.1)  # past the warm pool's quiet time after a launch
    host.warm.seed(program, 2)
    assert host.warm.wait_ready(program, 1, 0.1) == 0  # waiting for the starting instance
    # an instance that computes for long before its first call holds refills back only a while
    assert host.warm.wait_ready(program, 2, 10) == 2
    assert host.starts.active()
    host.terminate(spinning.id)
    spinning.finish(30)


def test_a_background_reaper_waits_while_instances_start_at_most_max_delay() -> None:
    class Store:
        closed_at: float | None = None

        def close(self) -> None:
            self.closed_at = time.monotonic()

    ramping = {"on": True}
    reaper = StoreReaper(lambda: True, max_delay_s=0.3, background=True, ramping=lambda: ramping["on"])
    try:
        a, b = Store(), Store()
        t0 = time.monotonic()
        reaper.put(a)
        wait_for(lambda: a.closed_at is not None, timeout=5, what="the store to be freed past max_delay_s")
        assert a.closed_at - t0 >= 0.25  # type: ignore[operator]  # it waited for the starts
        ramping["on"] = False
        t1 = time.monotonic()
        reaper.put(b)
        wait_for(lambda: b.closed_at is not None, timeout=5, what="the store to be freed")
        assert b.closed_at - t1 < 0.25  # type: ignore[operator]  # nothing starting: at once
    finally:
        reaper.close()


# ---- issue 40, fourth round: refills go on into slots used before while stores wait ----

@needs_nice
def test_a_refill_goes_on_into_reusable_slots_while_stores_wait_to_be_freed(
        host: Host, misbehave_wasm: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    [program] = host.warm_start([misbehave_wasm], per_program=2)  # primes 4 slots: used before, free
    host.prewarm(program, 0)  # (its parked instances' stores are freed as they end)
    reaper = host.wasm.reaper
    assert reaper is not None and reaper.wait_drained(10)
    assert host.wasm.reusable_slots() >= 2
    monkeypatch.setattr(reaper, "pending", lambda: 7)  # finished stores wait (a burst's, being freed)
    host.warm.seed(program, 2)
    assert host.warm.wait_ready(program, 2, 30) == 2  # into the slots used before, without waiting


@needs_nice
def test_a_refill_waits_for_the_frees_when_no_slot_used_before_is_free(
        host: Host, misbehave_wasm: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    program = host.compile(misbehave_wasm)
    reaper = host.wasm.reaper
    assert reaper is not None
    monkeypatch.setattr(reaper, "pending", lambda: 7)
    monkeypatch.setattr(host.wasm, "reusable_slots", lambda: 0)
    host.warm.seed(program, 2)
    assert host.warm.wait_ready(program, 1, 0.5) == 0  # a slot never used would fault in: it waits
    monkeypatch.setattr(reaper, "pending", lambda: 0)  # the frees are done
    assert host.warm.wait_ready(program, 2, 30) == 2


def test_the_engine_counts_the_slots_used_before_that_are_free(tmp_path: Path) -> None:
    from host.wasm.engine import WasmEngine
    from host.wasm.limits import InstanceLimits
    from host.wasm.pooling import PoolingConfig

    engine = WasmEngine(tmp_path, tick_ms=5, pooling=PoolingConfig(slots=8, limits=InstanceLimits(), warm_slots=2),
                        busy=lambda: False)
    plain = WasmEngine(tmp_path, tick_ms=5)
    try:
        stores = [engine.new_store() for _ in range(3)]
        assert engine.reusable_slots() == 0  # all three in use
        for store in stores[:2]:
            engine.free_store(store)
        assert engine.reaper is not None and engine.reaper.wait_drained(5)
        assert engine.reusable_slots() == 2
        engine.free_store(stores[2])
        assert engine.reaper.wait_drained(5)
        assert engine.reusable_slots() == 2  # 3 used before and free, but wasmtime keeps 2 warm
        engine.new_store()
        assert engine.reusable_slots() == 2 and engine.new_store() is not None and engine.reusable_slots() == 1
        plain.free_store(plain.new_store())
        assert plain.reusable_slots() == 0  # on-demand allocation: no slots
    finally:
        engine.close()
        plain.close()


@pytest.mark.build
def test_text_completion_bursts_back_to_back_with_parallel_warmers_and_reapers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host with the cores for two warmer and two reaper threads (one per four cores): the pool
    refills to its target and no further, and every instance of three bursts back to back, warm or
    cold, answers exactly."""
    import host.host as host_module

    monkeypatch.setattr(host_module, "background_threads", lambda: 2)
    fb = FakeBackend(page_size=16, num_pages=512, delay_s=0.002)
    h = Host(HostConfig(data_dir=tmp_path, max_instances=32, warm_auto=16, workers=0), backend=fb)
    try:
        assert len(h.wasm.reaper._threads) == 2  # type: ignore[union-attr]
        [prog] = h.warm_start([wasm_bytes("text_completion")], per_program=8)
        assert h.warm.ready_count(prog) == 8 and h.warm.warmers == 2
        for burst in range(3):
            got, wants = text_completion_burst(h, prog, [f"{burst}-{i:02d} tell me about lighthouses"
                                                         for i in range(12)], 16)
            assert got == wants
            assert h.warm.ready_count(prog) <= 12  # the demand's target (12 ran at once), never more
        wait_for(lambda: h.warm.ready_count(prog) == 12, timeout=30, what="the pool to refill to 12")
        time.sleep(0.2)
        assert h.warm.ready_count(prog) == 12
        assert [t.name for t in h.warm._threads if t.is_alive()] == ["pie-warm-0", "pie-warm-1"]
    finally:
        h.shutdown()


def test_only_a_warm_instance_calls_before_warm_store_and_before_its_store(host: Host, misbehave_wasm: bytes) -> None:
    """`InstanceEnv.before_warm_store` (an instance worker waits there for its reaper's frees) runs
    once for a warm start, before its store is made, and never for a cold one."""
    import dataclasses
    import queue

    from host.wasm.instance import Instance

    program = host.compile(misbehave_wasm)
    seen: list[int] = []
    env = dataclasses.replace(host._env, before_warm_store=lambda: seen.append(host.wasm._stores_live))
    live = host.wasm._stores_live
    warm = Instance(env, program, [], lambda ev: None, warm=True)
    warm.start()
    with warm.cond:
        assert warm.cond.wait_for(lambda: warm.at_first_call, 30)
    assert seen == [live]  # once, before its store counted
    events: queue.Queue = queue.Queue()
    cold = Instance(env, program, ["generate", "2", "5"], events.put)
    cold.start()
    assert cold.join(30)
    assert seen == [live]  # not for a cold start
    warm.terminate("done")
    assert warm.join(30)
