"""RunGate: at most `slots` instance threads run at once; wake-ups go out in order; stuck holders are passed by."""

from __future__ import annotations

import threading
import time

import pytest

from host.batching.gate import RunGate


@pytest.mark.parametrize("slots", [1, 2])
def test_at_most_slots_holders_and_reentry_is_a_no_op(slots: int) -> None:
    gate = RunGate(slots=slots, max_hold_s=5.0)
    inside, peak = [0], [0]
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(50):
            gate.enter()
            gate.enter()  # already held: no deadlock, no second slot
            with lock:
                inside[0] += 1
                peak[0] = max(peak[0], inside[0])
            time.sleep(0.0002)
            with lock:
                inside[0] -= 1
            gate.leave()
            assert not gate.held()

    threads = [threading.Thread(target=worker) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert peak[0] == slots


def test_a_holder_past_max_hold_is_passed_by() -> None:
    gate = RunGate(slots=1, max_hold_s=0.05)
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
    t.join(0.2)
    assert t.is_alive()  # nothing looks at the holders but the ticker's poll (the host's epoch ticker)
    for _ in range(100):  # the ticker: every 10 ms
        gate.poll()
        if not t.is_alive():
            break
        time.sleep(0.01)
    t.join(5)
    assert got["waited"] < 1.0 and got["held"] is False  # went ahead without the gate
    gate.leave()


def test_poll_leaves_waiters_alone_while_the_holders_move() -> None:
    gate = RunGate(slots=1, max_hold_s=0.05)
    gate.enter()
    got = {}

    def other() -> None:
        gate.enter()
        got["held"] = gate.held()
        gate.leave()

    t = threading.Thread(target=other)
    t.start()
    time.sleep(0.02)
    gate.poll()  # the holder took its slot 20 ms ago: not stuck
    t.join(0.05)
    assert t.is_alive()
    gate.leave()  # hands the slot over
    t.join(5)
    assert got["held"] is True


def test_wake_ups_go_out_in_order_one_per_free_slot() -> None:
    gate = RunGate(slots=1, max_hold_s=5.0)
    woken: list[int] = []

    def notify(i: int):  # noqa: ANN202
        def fn() -> bool:
            woken.append(i)
            return True  # "a thread was waiting"
        return fn

    gate.enter()  # a running instance holds the only slot
    for i in range(3):
        gate.wake(notify(i))
    assert woken == []  # queued behind the holder
    gate.leave()
    assert woken == [0]  # one wake-up per freed slot
    gate.enter()  # thread 0 arrives and takes the slot
    gate.leave()
    assert woken == [0, 1]

    gate2 = RunGate(slots=1, max_hold_s=5.0)
    gate2.wake(lambda: False)  # nobody was waiting: the slot stays free for the next one
    gate2.wake(notify(7))
    assert woken[-1] == 7


def test_disabled_gate_never_blocks_and_wakes_at_once() -> None:
    gate = RunGate(enabled=False)
    gate.enter()
    assert not gate.held()
    t = threading.Thread(target=gate.enter)
    t.start()
    t.join(1)
    assert not t.is_alive()
    hit = []
    gate.wake(lambda: hit.append(1) or True)
    assert hit == [1]


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        RunGate(slots=0)


def test_a_freed_slot_goes_to_the_longest_waiting_thread() -> None:
    gate = RunGate(slots=1, max_hold_s=5.0)
    gate.enter()  # the holder
    order: list[int] = []
    arrived = threading.Semaphore(0)

    def waiter(i: int) -> None:
        arrived.release()
        gate.enter()
        order.append(i)
        gate.leave()

    threads = []
    for i in range(4):
        t = threading.Thread(target=waiter, args=(i,))
        t.start()
        arrived.acquire()
        time.sleep(0.02)  # it is waiting in enter() before the next one arrives
        threads.append(t)
    assert order == []  # nobody passes the holder (it is not stuck: max_hold_s is long)
    gate.leave()
    for t in threads:
        t.join(5)
    assert order == [0, 1, 2, 3]
    assert not gate.held()
