"""The host freezes its start-up objects out of the cyclic GC's reach and collects the young
generation less often (HostConfig.tune_gc), and shortens the GIL switch interval while it runs
(HostConfig.switch_interval_ms).

Why it matters: a full collection scans every tracked object with all threads stopped; a host
holds ~190k of them (torch, the tokenizer, modules) for its whole life, so each full collection
stopped every instance and the scheduler for ~100 ms (bench/HISTORY.md, gc_max_ms).
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import time
import weakref
from pathlib import Path

import pytest
from fakes import FakeBackend
from helpers import text_completion_burst, wait_for, wasm_bytes

from host import Host, HostConfig


@pytest.fixture(autouse=True)
def _default_tune_gc(monkeypatch: pytest.MonkeyPatch) -> None:
    """HostConfig's own default here, also under make test-fast (PIE_TEST_TUNE_GC: tests/conftest.py)."""
    monkeypatch.delenv("PIE_TEST_TUNE_GC", raising=False)


def _tracked_ids(generations: range = range(3)) -> set[int]:
    return {id(o) for g in generations for o in gc.get_objects(g)}


@pytest.mark.heavy  # (~2-6 s: full collections over the whole test process; make test runs it)
def test_a_started_host_freezes_what_is_alive_and_its_shutdown_thaws_it(tmp_path: Path) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    assert before[0] < 10_000
    sentinel = [["made before the host"]]  # a tracked container, alive through the host's start
    assert id(sentinel) in _tracked_ids()
    h = Host(HostConfig(data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=64))
    try:
        assert gc.get_freeze_count() > 1000
        assert id(sentinel) not in _tracked_ids()  # frozen: no collection scans it
        assert id(h.scheduler) not in _tracked_ids()  # nor the host's own parts
        assert gc.get_threshold() == (10_000, before[1], before[2])  # young collections rarer
    finally:
        h.shutdown()
    assert gc.get_freeze_count() == 0
    assert id(sentinel) in _tracked_ids()
    assert gc.get_threshold() == before


def test_tune_gc_off_leaves_the_collector_as_it_is(tmp_path: Path) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    h = Host(HostConfig(data_dir=tmp_path, tune_gc=False), backend=FakeBackend(page_size=4, num_pages=64))
    try:
        assert gc.get_freeze_count() == 0
        assert id(h.scheduler) in _tracked_ids()
        assert gc.get_threshold() == before
    finally:
        h.shutdown()


@pytest.mark.heavy  # (~2-6 s: full collections over the whole test process; make test runs it)
def test_overlapping_hosts_restore_the_collector_when_the_last_one_ends(tmp_path: Path) -> None:
    gc.unfreeze()
    before = gc.get_threshold()
    a = Host(HostConfig(data_dir=tmp_path / "a"), backend=FakeBackend(page_size=4, num_pages=64))
    b = Host(HostConfig(data_dir=tmp_path / "b"), backend=FakeBackend(page_size=4, num_pages=64))
    a.shutdown()
    assert gc.get_threshold() == (10_000, before[1], before[2])  # b still runs: still tuned
    assert gc.get_freeze_count() > 0
    b.shutdown()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


class _Cycle:
    """A reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def _garbage_in_the_middle_generation() -> weakref.ref[_Cycle]:
    """A cycle aged into generation 1 and then dropped: a young collection does not free it, the
    next middle or full one does (with a young one every 10,000 allocations, ~100,000 from now)."""
    cycle = _Cycle()
    gc.collect(0)  # it survives (referenced here) and moves to generation 1
    ref = weakref.ref(cycle)
    del cycle
    return ref


@pytest.mark.heavy  # (~2-6 s: full collections over the whole test process; make test runs it)
def test_a_refilled_warm_pool_collects_while_the_host_is_idle(tmp_path: Path) -> None:
    """Left to the collector, middle and full collections came due inside bursts of launches (a
    13-36 ms pause with every thread stopped, in 2 of 7 bursts of 256); the host collects fully
    when the pool has refilled, i.e. while it is idle."""
    gc.unfreeze()
    h = Host(HostConfig(data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=64))
    try:
        program = h.compile(wasm_bytes("misbehave"))
        ref = _garbage_in_the_middle_generation()
        assert h.prewarm(program, 2) == 2
        wait_for(lambda: ref() is None, what="the idle collection after the refill")
    finally:
        h.shutdown()


def test_without_tune_gc_the_host_does_not_collect_on_refill(tmp_path: Path) -> None:
    gc.unfreeze()
    h = Host(HostConfig(data_dir=tmp_path, tune_gc=False), backend=FakeBackend(page_size=4, num_pages=64))
    gc.disable()  # no automatic collection either: only one by the host would free the cycle
    try:
        program = h.compile(wasm_bytes("misbehave"))
        ref = _garbage_in_the_middle_generation()
        assert h.prewarm(program, 2) == 2
        time.sleep(0.3)  # the warm pool's thread has long finished its refill
        assert ref() is not None
    finally:
        gc.enable()
        h.shutdown()


@pytest.mark.heavy  # (~2-6 s: full collections over the whole test process; make test runs it)
def test_a_host_sets_the_gil_switch_interval_and_the_last_one_out_restores_it(tmp_path: Path) -> None:
    """HostConfig.switch_interval_ms: the scheduler's thread gets the GIL back sooner while instances
    run Python (bench/gpu_suite_notes.md); 0 leaves Python's interval alone."""
    before = sys.getswitchinterval()
    a = Host(HostConfig(data_dir=tmp_path / "a", switch_interval_ms=0.25), backend=FakeBackend(page_size=4, num_pages=64))
    try:
        assert sys.getswitchinterval() == 0.00025
        b = Host(HostConfig(data_dir=tmp_path / "b", switch_interval_ms=1.0), backend=FakeBackend(page_size=4, num_pages=64))
        assert sys.getswitchinterval() == 0.001
        b.shutdown()
        assert sys.getswitchinterval() != before  # a still runs
    finally:
        a.shutdown()
    assert sys.getswitchinterval() == before
    c = Host(HostConfig(data_dir=tmp_path / "c", switch_interval_ms=0), backend=FakeBackend(page_size=4, num_pages=64))
    try:
        assert sys.getswitchinterval() == before
    finally:
        c.shutdown()
    with pytest.raises(ValueError, match="switch_interval_ms"):
        HostConfig(switch_interval_ms=-1)


@pytest.mark.parametrize(("device", "want_s"), [("cuda:0", 0.0005), ("cpu", None)])
def test_the_default_switch_interval_is_short_on_a_cuda_backend_only(tmp_path: Path, device: str,
                                                                     want_s: float | None) -> None:
    """By default the host shortens the interval where it was measured to help (a CUDA backend);
    elsewhere (a CPU backend, a user's backend with only `forward`) it leaves Python's: the short
    interval cost bursts of 64 behind a forward-only backend ~0.05-0.08 of their efficiency (issue 56)."""
    before = sys.getswitchinterval()
    fb = FakeBackend(page_size=4, num_pages=64)
    fb.info = dataclasses.replace(fb.info, device=device)
    h = Host(HostConfig(data_dir=tmp_path), backend=fb)
    try:
        assert sys.getswitchinterval() == (before if want_s is None else want_s)
        assert h.switch_interval_ms == (0.0 if want_s is None else 0.5)
    finally:
        h.shutdown()
    assert sys.getswitchinterval() == before


@pytest.mark.build
@pytest.mark.parametrize("ms", [0.0, 0.1])
def test_text_completion_bursts_give_the_same_text_at_any_switch_interval(tmp_path: Path, ms: float) -> None:
    """The standard inferlet, 24 at once, under Python's interval and a short one: exact outputs."""
    fb = FakeBackend(page_size=16, num_pages=512, delay_s=0.002)
    h = Host(HostConfig(data_dir=tmp_path, switch_interval_ms=ms), backend=fb)
    try:
        prog = h.compile(wasm_bytes("text_completion"))
        got, wants = text_completion_burst(h, prog, [f"{i:03d} tell me about lighthouses" for i in range(24)], 32)
        assert got == wants
    finally:
        h.shutdown()
