"""RunGate: one instance thread runs at a time; a stuck holder is passed by."""

from __future__ import annotations

import threading
import time

from host.gate import RunGate


def test_one_holder_at_a_time_and_reentry_is_a_no_op() -> None:
    gate = RunGate(max_hold_s=5.0)
    inside, peak = [0], [0]
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            gate.enter()
            gate.enter()  # already held: no deadlock
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.0002)
            with lock:
                inside[0] -= 1
            gate.leave()
            assert not gate.held()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak[0] == 1


def test_a_holder_past_max_hold_is_passed_by() -> None:
    gate = RunGate(max_hold_s=0.05)
    gate.enter()  # this thread now "computes" for long
    got = {}

    def other() -> None:
        t0 = time.perf_counter()
        gate.enter()
        got["waited"] = time.perf_counter() - t0
        got["held"] = gate.held()
        gate.leave()

    t = threading.Thread(target=other)
    t.start()
    t.join(5)
    assert got["waited"] < 1.0 and got["held"] is False  # went ahead without the gate
    gate.leave()


def test_disabled_gate_never_blocks() -> None:
    gate = RunGate(enabled=False)
    gate.enter()
    assert not gate.held()
    t = threading.Thread(target=gate.enter)
    t.start()
    t.join(1)
    assert not t.is_alive()
