"""Service levels (host/levels.py): priorities, aging and tenants in turn in a full batch."""

from __future__ import annotations

import time

import pytest
from test_scheduler import Recorder, make, req

from host.levels import PRIORITY_MAX, PRIORITY_MIN, Turns, check_priority


def test_check_priority_names_the_bad_value() -> None:
    assert check_priority(0) == 0 and check_priority(PRIORITY_MIN) == PRIORITY_MIN
    with pytest.raises(ValueError, match=r"priority must be from -1000 to 1000.*got 1001"):
        check_priority(PRIORITY_MAX + 1)
    for bad in ("1", 1.5, True, None):
        with pytest.raises(TypeError, match="priority must be an integer"):
            check_priority(bad)


def test_turns_order_priority_then_tenants_round_robin_then_aged_first() -> None:
    t = Turns(aging_s=10)
    items = [("a", 0, 5.0), ("a", 0, 5.0), ("a", 0, 5.0), ("b", 0, 5.0), ("c", -1, 5.0), ("b", 1, 5.0)]
    order = t.order(list(range(len(items))), lambda i: items[i][1], lambda i: items[i][0], lambda i: items[i][2], 6.0)
    assert order == [4, 0, 3, 1, 2, 5]  # c (-1); then a and b at rank 0; a's rest; b's priority 1
    t.served(["a"])  # a was served last: b goes first at the same rank next time
    order = t.order([0, 3], lambda i: items[i][1], lambda i: items[i][0], lambda i: items[i][2], 6.0)
    assert order == [3, 0]
    old = [("a", 0, 5.0), ("z", 100, 0.0)]  # z has waited past aging_s: ahead of everyone
    assert t.order([0, 1], lambda i: old[i][1], lambda i: old[i][0], lambda i: old[i][2], 10.5) == [1, 0]


def test_a_full_batch_takes_higher_priority_first() -> None:
    rec = Recorder()
    s = make(rec, max_batch_tokens=4)
    s.set_class("lo", 5, "t")
    s.set_class("hi", -5, "t")
    rec.hold(s)
    lo = [s.submit(req([i], 2, 2, tag=i), "lo") for i in range(1, 3)]
    hi = [s.submit(req([10 + i], 2, 2, tag=10 + i), "hi") for i in range(1, 3)]
    rec.gate.set()
    for f in lo + hi:
        f.wait(5)
    assert rec.batches[1:] == [[11, 12], [1, 2]]
    lv = s.level_stats()
    assert lv["by_priority"]["-5"]["count"] == 2 and lv["by_priority"]["5"]["count"] == 2
    assert lv["by_tenant"]["t"]["count"] == 4
    s.stop()


def test_a_full_batch_serves_tenants_in_turn() -> None:
    rec = Recorder()
    s = make(rec, max_batch_tokens=2)
    for k in range(6):
        s.set_class(f"a{k}", 0, "A")
    s.set_class("b", 0, "B")
    rec.hold(s)
    flood = [s.submit(req([k], 1, 1, tag=k), f"a{k}") for k in range(6)]
    b = s.submit(req([20], 1, 1, tag=20), "b")
    rec.gate.set()
    for f in [*flood, b]:
        f.wait(5)
    assert 20 in rec.batches[1]  # not behind A's six
    s.stop()


def test_an_owners_forwards_keep_their_order_whatever_the_priorities() -> None:
    rec = Recorder()
    s = make(rec, max_batch_tokens=2)
    s.set_class("x", 3, "t")
    rec.hold(s)
    first = s.submit(req([1], 2, 2, tag=1), "x")
    s.set_class("x", -3, "t")  # raised while its first forward waits
    second = s.submit(req([2], 2, 2, tag=2), "x")
    s.set_class("y", 0, "t")
    other = s.submit(req([3], 2, 2, tag=3), "y")
    rec.gate.set()
    for f in (first, second, other):
        f.wait(5)
    assert rec.batches.index([1]) < rec.batches.index([2])
    s.stop()


def test_a_low_priority_owner_under_constant_high_priority_load_is_aged_in() -> None:
    rec = Recorder(delay=0.005)
    s = make(rec, max_batch_tokens=2)
    s.turns.aging_s = 0.1
    s.set_class("lo", 10, "t")
    for k in range(4):
        s.set_class(f"hi{k}", -10, "t")
    stop = time.monotonic() + 5
    lo = s.submit(req([50], 2, 2, tag=50), "lo")
    while not lo.done() and time.monotonic() < stop:  # the high-priority queue never drains
        futs = [s.submit(req([k], 2, 2, tag=k), f"hi{k}") for k in range(4)]
        futs[0].wait(5)
    assert lo.done(), "a low-priority forward starved"
    assert time.monotonic() < stop
    assert s.level_stats()["aged"] >= 1
    s.stop()


def _queue_host(tmp_path, **kw):  # noqa: ANN001, ANN202
    from fakes import FakeBackend

    from host import Host, HostConfig

    return Host(HostConfig(max_instances=1, warm_auto=0, data_dir=tmp_path / "h", **kw),
                backend=FakeBackend(page_size=4, num_pages=64))


def _admitted_in_order(host, ids: list[str]) -> list[str]:  # noqa: ANN001
    """End the running instance, note which queued one starts next, until all have run."""
    from helpers import wait_for

    order: list[str] = []
    while len(order) < len(ids):
        states = {i["id"]: i["state"] for i in host.instances()}
        running = [i for i in states if states[i] != "queued"]
        if not running:  # the next one is being started
            time.sleep(0.01)
            continue
        assert len(running) == 1
        if running[0] in ids:
            order.append(running[0])
        host.terminate(running[0])
        wait_for(lambda r=running[0]: r not in {i["id"] for i in host.instances()}, 30)
    return order


def test_the_launch_queue_admits_by_priority_then_tenants_in_turn(tmp_path) -> None:  # noqa: ANN001
    from helpers import wasm_bytes

    host = _queue_host(tmp_path)
    try:
        prog = host.compile(wasm_bytes("blocked_receive"))
        host.launch(prog, [])  # takes the only slot
        a1 = host.launch(prog, [], tenant="A", priority=0)
        a2 = host.launch(prog, [], tenant="A", priority=0)
        a3 = host.launch(prog, [], tenant="A", priority=0)
        b1 = host.launch(prog, [], tenant="B", priority=0)
        lo = host.launch(prog, [], tenant="B", priority=7)
        hi = host.launch(prog, [], tenant="C", priority=-7)
        lv = host.stats()["levels"]["launch_queue"]
        assert lv["by_priority"]["0"]["queued"] == 4 and lv["by_tenant"]["A"]["queued"] == 3
        assert _admitted_in_order(host, [a1, a2, a3, b1, lo, hi]) == [hi, a1, b1, a2, a3, lo]
        lv = host.stats()["levels"]["launch_queue"]
        assert lv["by_priority"]["7"]["count"] == 1 and lv["by_tenant"]["A"]["count"] == 3
        with pytest.raises(ValueError, match="priority must be from"):
            host.launch(prog, [], priority=5000)
        with pytest.raises(TypeError, match="priority must be an integer"):
            host.launch(prog, [], priority="1")  # type: ignore[arg-type]
    finally:
        host.shutdown()


def test_a_low_priority_launch_is_aged_in_under_constant_high_priority_launches(tmp_path) -> None:  # noqa: ANN001
    from helpers import wait_for, wasm_bytes

    host = _queue_host(tmp_path, priority_aging_s=0.3)
    try:
        prog = host.compile(wasm_bytes("blocked_receive"))
        first = host.launch(prog, [])
        lo = host.launch(prog, [], priority=9)
        running = first
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            host.launch(prog, [], priority=-9)  # always one high-priority launch waiting
            time.sleep(0.05)
            host.terminate(running)
            wait_for(lambda r=running: r not in {i["id"] for i in host.instances()}, 30)
            wait_for(lambda: any(i["state"] != "queued" for i in host.instances()), 30)
            running = next(i["id"] for i in host.instances() if i["state"] != "queued")
            if running == lo:
                break
        assert running == lo, "the low-priority launch starved"
        assert host.stats()["levels"]["launch_queue"]["aged"] >= 1
    finally:
        host.shutdown()


def _guest(iid: str, tenant: str, priority: int):  # noqa: ANN202
    """An instance as the imports see it (bound to this thread, as a guest's calls are)."""
    from types import SimpleNamespace

    from host.state.pages import InstancePages
    pages = InstancePages(tenant)
    pages.priority = priority
    return SimpleNamespace(id=iid, pages=pages, parked=False, stepper=None, trap_reason=None)


def test_a_guest_lowering_its_priority_runs_after_a_higher_one_in_a_full_batch() -> None:
    import wasmtime

    from host.api import runtime
    from host.replicas import Replica
    from host.state.pages import PageManager
    from host.wasm.calling import calling

    rec = Recorder()
    s = make(rec, max_batch_tokens=4)
    table = runtime.imports("0.4.0", [Replica(0, PageManager(64), s)])
    g = _guest("g", "t", -5)  # launched ahead of "o"...
    s.set_class("g", -5, "t")
    s.set_class("o", 0, "t")
    calling.instance = g
    try:
        assert table["priority"](None) == -5
        table["set-priority"](None, 10)  # ...then lowers itself behind it
        assert table["priority"](None) == 10 and g.pages.priority == 10
        with pytest.raises(wasmtime.WasmtimeError) as e:
            table["set-priority"](None, 1001)
        msg = "runtime.set-priority: priority must be from -1000 to 1000 (lower runs sooner), got 1001"
        assert str(e.value) == msg and g.trap_reason == msg
        assert g.pages.priority == 10  # a refused value changes nothing
    finally:
        calling.instance = None
    rec.hold(s)
    mine = [s.submit(req([i], 2, 2, tag=i), "g") for i in range(1, 3)]
    other = [s.submit(req([10 + i], 2, 2, tag=10 + i), "o") for i in range(1, 3)]
    rec.gate.set()
    for f in mine + other:
        f.wait(5)
    assert rec.batches[1:] == [[11, 12], [1, 2]]
    assert s.level_stats()["by_priority"]["10"]["count"] == 2
    s.stop()
