"""HostConfig.launch_grace_ms: how long a burst's first batch waits for the launched instances'
first forwards (host/batching/policy.py, AdaptivePolicy.launch_grace_s)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fakes import FakeBackend
from helpers import text_completion_burst, wasm_bytes

from host import Host, HostConfig
from host.batching.gate import RunGate
from host.batching.policy import AdaptivePolicy


@pytest.mark.parametrize("bad", [-1.0, 10_001.0])
def test_launch_grace_out_of_range_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="launch_grace_ms"):
        HostConfig(launch_grace_ms=bad)


def test_launch_grace_reaches_the_adaptive_policy(tmp_path: Path) -> None:
    h = Host(HostConfig(data_dir=tmp_path, launch_grace_ms=40.0), backend=FakeBackend(page_size=16, num_pages=64))
    try:
        policy = h.scheduler.policy
        assert isinstance(policy, AdaptivePolicy) and policy.launch_grace_s == pytest.approx(0.04)
    finally:
        h.shutdown()


@contextmanager
def slots_held(gate: RunGate) -> Iterator[None]:
    """Every run slot taken by an idle thread: launched instances stay parked (their wake-ups queue)
    until the block ends, so a burst's launches all come before any instance submits, however the
    launching thread is scheduled (on a loaded machine, the first instances had submitted before the
    last launch, and a launch that finds the scheduler busy is not waited for: first batch 9 or 11)."""
    go, taken = threading.Event(), threading.Semaphore(0)

    def hold() -> None:
        gate.enter()
        taken.release()
        go.wait()
        gate.leave()

    threads = [threading.Thread(target=hold) for _ in range(gate.slots)]
    for t in threads:
        t.start()
    for _ in threads:
        taken.acquire()
    try:
        yield
    finally:
        go.set()
        for t in threads:
            t.join()


def test_a_long_grace_gathers_a_bursts_first_prefills_and_fires_when_all_have_come(tmp_path: Path) -> None:
    """text_completion, bursts of 12 onto an idle host with a 2 s grace: each burst's first batch
    holds all 12 prefills, it fires as soon as the last has come (well before the 2 s), and every
    output is exact."""
    fb = FakeBackend(page_size=16, num_pages=512, delay_s=0.002)
    h = Host(HostConfig(data_dir=tmp_path, launch_grace_ms=2000.0), backend=fb)
    try:
        [prog] = h.warm_start([wasm_bytes("text_completion")], per_program=12)
        for burst in range(2):
            assert h.warm.wait_ready(prog, 12, 30.0) == 12  # all 12 parked again
            first = len(fb.batches)
            t = time.perf_counter()
            got, wants = text_completion_burst(h, prog, [f"{burst}-{i:02d} how do tides work" for i in range(12)], 10,
                                               lambda: slots_held(h.gate))
            assert got == wants
            assert time.perf_counter() - t < 1.9  # not held to the grace's bound
            assert fb.batches[first] == 12
    finally:
        h.shutdown()
