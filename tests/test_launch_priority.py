"""Launch priority (host/batching/launch.py): instances' host calls wait while a batch is launched."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from fakes import FakeBackend
from helpers import text_completion_burst, wasm_bytes

from gpu_backend.types import Feed, ForwardRequest
from host import Host, HostConfig
from host.batching.launch import LaunchPriority


def _waiter(p: LaunchPriority) -> tuple[threading.Thread, list[float]]:
    took: list[float] = []

    def run() -> None:
        t = time.perf_counter()
        p.wait()
        took.append(time.perf_counter() - t)

    th = threading.Thread(target=run)
    th.start()
    return th, took


def test_wait_returns_at_once_without_a_launch_and_blocks_during_one() -> None:
    p = LaunchPriority(max_wait_s=5.0)
    t = time.perf_counter()
    p.wait()
    assert time.perf_counter() - t < 0.05 and p.waits == 0
    with p:
        assert p.launching()
        th, took = _waiter(p)
        time.sleep(0.15)
        assert not took  # still waiting for the launch
    th.join(2)
    assert took and 0.1 < took[0] < 2.0
    assert p.waits == 1 and not p.launching()


def test_wait_is_bounded_and_overlapping_launches_clear_at_the_last_end() -> None:
    p = LaunchPriority(max_wait_s=0.1)
    with p:
        t = time.perf_counter()
        p.wait()  # a launch that never ends holds nobody past max_wait_s
        assert 0.08 < time.perf_counter() - t < 1.0
    q = LaunchPriority(max_wait_s=5.0)
    q.__enter__()
    q.__enter__()  # two schedulers (replicas) launching at once
    q.__exit__(None, None, None)
    assert q.launching()
    th, took = _waiter(q)
    time.sleep(0.1)
    assert not took
    q.__exit__(None, None, None)
    th.join(2)
    assert took and not q.launching()


def test_disabled_never_waits() -> None:
    p = LaunchPriority(enabled=False, max_wait_s=5.0)
    with p:
        assert not p.launching()
        t = time.perf_counter()
        p.wait()
        assert time.perf_counter() - t < 0.05 and p.waits == 0


class _Recording(FakeBackend):
    """Records, at each launch, whether it was fed (launched behind a running batch) and whether the
    host's launch priority was on."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.priority: LaunchPriority | None = None
        self.seen: list[tuple[bool, bool]] = []

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None):  # type: ignore[no-untyped-def]
        if self.priority is not None:
            self.seen.append((feed is not None, self.priority.launching()))
        return super().start_forward(reqs, feed)


@pytest.mark.parametrize("run_ahead", [True, False])
def test_the_scheduler_launches_under_the_priority_only_when_the_launch_overlaps(
        tmp_path: Path, run_ahead: bool) -> None:
    """With run_ahead the backend's `start_forward` is the launch, and a launch onto an idle device
    runs under the priority; one behind a running batch (fed) does not: it may block until that batch
    has run. Without run_ahead, `forward` runs the whole batch and instances must not wait for it."""
    fb = _Recording(page_size=16, num_pages=256)
    h = Host(HostConfig(data_dir=tmp_path, run_ahead=run_ahead), backend=fb)
    try:
        fb.priority = h.launch_priority
        prog = h.compile(wasm_bytes("text_completion"))
        got, wants = text_completion_burst(h, prog, ["what is a lighthouse"], 8)
        assert got == wants
        idle = [on for fed, on in fb.seen if not fed]
        behind = [on for fed, on in fb.seen if fed]
        if run_ahead:
            assert idle and all(idle) and behind and not any(behind)
        else:
            assert not behind and idle and not any(idle)
    finally:
        h.shutdown()


@pytest.mark.parametrize("on", [True, False])
def test_text_completion_bursts_with_launches_that_give_the_gil_up(tmp_path: Path, on: bool) -> None:
    """The standard inferlet, bursts of 16 on a backend whose prefill launches give the GIL up 300
    times (as an eager CUDA launch does): exact outputs with the priority on and off; on, host calls
    did wait for launches."""
    fb = FakeBackend(page_size=16, num_pages=512, delay_s=0.002)
    fb.launch_ops = 300
    h = Host(HostConfig(data_dir=tmp_path, launch_priority=on), backend=fb)
    try:
        [prog] = h.warm_start([wasm_bytes("text_completion")], per_program=8)
        for burst in range(2):
            got, wants = text_completion_burst(h, prog, [f"{burst}-{i:02d} tell me about tides" for i in range(16)],
                                               12)
            assert got == wants
        assert (h.launch_priority.waits > 0) == on
    finally:
        h.shutdown()
