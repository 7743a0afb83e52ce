"""Under KV pressure nothing fails (host/suspend.py): instances needing 8x the pool all complete
with the outputs they have with a pool that holds them all.

The backend is the stand-in with `reads=True`: each drawn token depends on every token stored in
the pages the pass attends to, so a page lost, mixed up or restored into the wrong place by a
suspension changes the output. The reference outputs come from the same workloads on a host
whose pool holds everything at once (no suspension there: checked).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest
from fakes import FakeBackend
from helpers import Run, text_completion_burst, wait_for, wasm_bytes

from host import Host, HostConfig

pytestmark = pytest.mark.build

PS = 4


def _host(tmp_path, num_pages: int, **kw) -> tuple[Host, FakeBackend]:  # noqa: ANN001, ANN003
    fb = FakeBackend(page_size=PS, num_pages=num_pages, delay_s=0.001, reads=True)
    return Host(HostConfig(data_dir=tmp_path, warm_auto=0, **kw), backend=fb), fb


def _run_all(h: Host, prog: str, arglists: list[list[str]], timeout: float = 240.0) -> list[tuple[str, str]]:
    runs = [Run(h, prog, args) for args in arglists]
    return [(e.event, e.message) for e in (r.finish(timeout) for r in runs)]


@pytest.fixture(scope="module")
def programs() -> dict[str, bytes]:
    return {"pressure": wasm_bytes("pressure"), "beam": wasm_bytes("beam_search")}


def _check_outputs(tmp_path, programs: dict[str, bytes], name: str, arglists: list[list[str]],  # noqa: ANN001
                   pool: int) -> dict[str, int]:
    """Run `arglists` on a host with a pool holding all of them, then on one with `pool` pages:
    the same events and outputs; the pages and the swap space all come back; returns the stats."""
    big, _ = _host(tmp_path / "big", 4096)
    try:
        prog = big.compile(programs[name])
        want = _run_all(big, prog, arglists)
        assert big.stats()["memory"]["suspensions"] == 0
    finally:
        big.shutdown()
    assert all(ev == "completed" for ev, _ in want), want
    small, _fb = _host(tmp_path / "small", pool)
    try:
        prog = small.compile(programs[name])
        got = _run_all(small, prog, arglists)
        assert got == want
        mem = small.stats()["memory"]
        wait_for(lambda: small.free_pages() == pool, 10)
        assert small.stats()["memory"]["swap_used_bytes"] == 0
        assert mem["suspended"] == 0 and mem["waiting"] == 0
        return mem
    finally:
        small.shutdown()


def test_host_side_loops_needing_8x_the_pool_all_complete_exactly(tmp_path, programs) -> None:  # noqa: ANN001
    # 16 instances, each 8 prompt + 56 drawn tokens = 16 pages at its end; the pool has 32
    arglists = [["host", "56", "-1", *[str(10 + i + j) for j in range(8)]] for i in range(16)]
    mem = _check_outputs(tmp_path, programs, "pressure", arglists, pool=32)
    assert mem["suspensions"] > 0 and mem["resumes"] == mem["suspensions"]
    assert mem["swapped_bytes"] == mem["swapped_pages"] * 8 * PS > 0


def test_seeded_host_loops_complete_exactly(tmp_path, programs) -> None:  # noqa: ANN001
    arglists = [["host", "40", str(100 + i), *[str(30 + i) for _ in range(5)]] for i in range(12)]
    mem = _check_outputs(tmp_path, programs, "pressure", arglists, pool=24)
    assert mem["suspensions"] > 0


def test_guest_driven_steps_needing_8x_the_pool_all_complete_exactly(tmp_path, programs) -> None:  # noqa: ANN001
    arglists = [["steps", "57", *[str(40 + i + j) for j in range(7)]] for i in range(16)]
    mem = _check_outputs(tmp_path, programs, "pressure", arglists, pool=32)
    assert mem["suspensions"] > 0


def test_mixed_workloads_needing_8x_the_pool_all_complete_exactly(tmp_path, programs) -> None:  # noqa: ANN001
    """Host-side loops (greedy and seeded), stepping guests and guests with queued forwards together."""
    arglists = []
    for i in range(16):
        prompt = [str(60 + i + j) for j in range(6)]
        arglists.append([["host", "50", "-1", *prompt], ["host", "50", str(i), *prompt], ["steps", "50", *prompt],
                         ["queued", "56", str(60 + i)]][i % 4])
    mem = _check_outputs(tmp_path, programs, "pressure", arglists, pool=28)
    assert mem["suspensions"] > 0


def test_queued_forwards_keep_their_order_across_a_suspension(tmp_path, programs) -> None:  # noqa: ANN001
    arglists = [["queued", "40", str(20 + i)] for i in range(12)]
    mem = _check_outputs(tmp_path, programs, "pressure", arglists, pool=20)
    assert mem["suspensions"] > 0


def test_beam_search_forked_shared_pages_complete_exactly(tmp_path, programs) -> None:  # noqa: ANN001
    arglists = [["--raw", "-p", f"sea {i} " * 3, "-w", "3", "-n", "40"] for i in range(12)]
    mem = _check_outputs(tmp_path, programs, "beam", arglists, pool=40)
    assert mem["suspensions"] > 0


def test_exporter_and_importers_under_pressure(tmp_path, programs) -> None:  # noqa: ANN001
    """Importers of a held export run under pressure: the exported pages are shared, never moved;
    the importers' own pages are, and they all see the exporter's context."""

    def run(pool: int) -> tuple[list[tuple[str, str]], dict[str, int]]:
        h, _fb = _host(tmp_path / f"p{pool}", pool)
        try:
            prog = h.compile(programs["pressure"])
            exporter = Run(h, prog, ["export", "ctx", *[str(7 + j) for j in range(10)]])
            assert exporter.events.get(timeout=60).message == "exported"
            got = _run_all(h, prog, [["import", "ctx", "40"] for _ in range(10)])
            h.signal(exporter.id, "go")
            assert exporter.finish(60).event == "completed"
            wait_for(lambda: h.free_pages() == pool, 10)
            return got, h.stats()["memory"]
        finally:
            h.shutdown()

    want, mem0 = run(4096)
    got, mem = run(24)
    assert all(ev == "completed" for ev, _ in want) and got == want
    assert mem0["suspensions"] == 0 and mem["suspensions"] > 0 and mem["swap_used_bytes"] == 0


def test_an_instance_that_can_never_fit_fails_at_once(tmp_path, programs) -> None:  # noqa: ANN001
    h, _fb = _host(tmp_path, 16)
    try:
        prog = h.compile(programs["pressure"])
        other = Run(h, prog, ["steps", "40", "1", "2"])  # fits: not disturbed
        t0 = time.perf_counter()
        ev = Run(h, prog, ["steps", "100", "5", "6"]).finish(60)  # 102 tokens: 26 pages of 16
        assert time.perf_counter() - t0 < 10
        assert ev.event == "out_of_resources", ev
        assert "17 KV pages" in ev.message and "has 16" in ev.message and "can never fit" in ev.message
        assert h.stats()["memory"]["out_of_resources"] == 1
        assert other.finish(60).event == "completed"
        wait_for(lambda: h.free_pages() == 16, 10)
    finally:
        h.shutdown()


@pytest.mark.parametrize("how", ["terminate", "budget"])
def test_a_suspended_instance_ends_by_terminate_or_budget_and_frees_its_swap(tmp_path, programs, how) -> None:  # noqa: ANN001
    h, _fb = _host(tmp_path, 16, wall_budget_s=4.0 if how == "budget" else None)
    try:
        prog = h.compile(programs["pressure"])
        first = Run(h, prog, ["grow", "10"])
        assert first.events.get(timeout=60).message == "held"
        second = Run(h, prog, ["grow", "10"])  # its 7th page suspends the first (it waits for a message)
        assert second.events.get(timeout=60).message == "held"
        mem = h.stats()["memory"]
        assert mem["suspended"] == 1 and mem["swap_used_bytes"] == 10 * 8 * PS
        assert h._instances[first.id].pages.state == "suspended"  # noqa: SLF001
        if how == "terminate":
            h.terminate(first.id, "stop")
            assert first.finish(30).event == "aborted"
        else:
            end = first.finish(30)
            assert end.event == "exception" and "budget" in end.message
        wait_for(lambda: h.stats()["memory"]["suspended"] == 0, 10)
        assert h.stats()["memory"]["swap_used_bytes"] == 0
        if how == "terminate":
            h.signal(second.id, "go")
            assert second.finish(30).event == "completed"
        else:
            second.finish(30)
        wait_for(lambda: h.free_pages() == 16, 10)
    finally:
        h.shutdown()


def test_new_instances_wait_behind_a_suspended_one(tmp_path, programs) -> None:  # noqa: ANN001
    """A suspended instance resumes before a newcomer takes pages (no starvation)."""
    h, _fb = _host(tmp_path, 16)
    try:
        prog = h.compile(programs["pressure"])
        first = Run(h, prog, ["grow", "10"])
        assert first.events.get(timeout=60).message == "held"
        second = Run(h, prog, ["grow", "10"])
        assert second.events.get(timeout=60).message == "held"  # the first is suspended
        newcomer = Run(h, prog, ["grow", "4"])  # 6 pages are free, but the first waits for 10
        time.sleep(0.5)
        assert newcomer.events.empty()
        h.signal(second.id, "go")  # its 10 pages come free: the first resumes, then the newcomer fits
        assert second.finish(30).event == "completed"
        assert newcomer.events.get(timeout=30).message == "held"
        assert h.stats()["memory"]["resumes"] == 1
        h.signal(first.id, "go")
        h.signal(newcomer.id, "go")
        assert first.finish(30).event == "completed" and newcomer.finish(30).event == "completed"
        wait_for(lambda: h.free_pages() == 16, 10)
    finally:
        h.shutdown()


def test_no_swap_space_refuses_with_a_clear_message_instead_of_hanging(tmp_path, programs) -> None:  # noqa: ANN001
    h, _fb = _host(tmp_path, 16, swap_memory_bytes=0)
    try:
        prog = h.compile(programs["pressure"])
        runs = [Run(h, prog, ["steps", "40", str(i), str(i + 1)]) for i in range(4)]
        ends = [r.finish(120) for r in runs]
        assert "completed" in [e.event for e in ends]
        for e in ends:
            assert e.event in ("completed", "out_of_resources"), e
            if e.event == "out_of_resources":
                assert "swap space" in e.message
        wait_for(lambda: h.free_pages() == 16, 10)
    finally:
        h.shutdown()


class _SmallPool:
    """The session's real backend behind a host that uses only its first `num_pages` pages."""

    def __init__(self, backend: Any, num_pages: int) -> None:
        self._backend = backend
        self.info = dataclasses.replace(backend.info, num_pages=num_pages)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


@pytest.mark.parametrize("mode", ["host-greedy", "host-seeded", "steps"])
def test_real_model_suspended_and_resumed_equals_the_uninterrupted_run(backend, real_host, tmp_path, mode) -> None:  # noqa: ANN001
    tok = backend.tokenizer
    prompts = [tok.encode(f"Write one line about the number {i} and the sea.") for i in range(4)]
    if mode == "steps":
        arglists = [["steps", "40", *map(str, p)] for p in prompts]
    else:
        seed = "-1" if mode == "host-greedy" else "7"
        arglists = [["host", "40", seed, *map(str, p)] for p in prompts]
    program = real_host.compile(wasm_bytes("pressure"))
    want = _run_all(real_host, program, arglists, timeout=600)
    assert all(ev == "completed" for ev, _ in want), want
    pages = max(-(-(len(p) + 41) // 16) for p in prompts)  # one instance's pages at its end
    small = Host(HostConfig(data_dir=tmp_path, warm_auto=0), backend=_SmallPool(backend, pages + 1))
    try:
        got = _run_all(small, small.compile(wasm_bytes("pressure")), arglists, timeout=600)
        assert got == want
        assert small.stats()["memory"]["suspensions"] > 0
        wait_for(lambda: small.free_pages() == pages + 1, 10)
    finally:
        small.shutdown()


def test_text_completion_bursts_on_a_pool_for_two_all_complete(tmp_path) -> None:  # noqa: ANN001
    """The standard inferlet (forward.generate-fresh, then generate after each suspension): a loop
    ended for a suspension right after a page was started for its next step, or before its first
    token, hands back only pages the SDK knows of (it trapped with `last-page-len 0` here)."""
    prompt = "Write a story about a lighthouse."
    fb = FakeBackend(page_size=16, num_pages=20, delay_s=0.01)
    h = Host(HostConfig(data_dir=tmp_path, warm_auto=0), backend=fb)
    try:
        prog = h.compile(wasm_bytes("text_completion"))
        for _round in range(4):
            got, wants = text_completion_burst(h, prog, [f"{i:04d} {prompt}" for i in range(16)], 96)
            assert got == wants
        assert h.stats()["memory"]["suspensions"] > 0
        wait_for(lambda: h.free_pages() == 20, 10)
    finally:
        h.shutdown()


def test_engine_processes_suspend_too_with_the_copies_kept_in_the_engine(tmp_path, programs) -> None:  # noqa: ANN001
    """`--engine process` (the stand-in in an engine process): the swapped pages stay in the engine
    process; steppers needing ~8x the pool all complete, with the outputs of a pool for all."""
    from gpu_backend.engine.client import EngineSpec, start_engines

    arglists = [["steps", "57", *[str(40 + i + j) for j in range(7)]] for i in range(12)]
    engines = start_engines(EngineSpec(standin=True, page_size=PS, num_pages=24, standin_delay_s=0.001), 1)
    h = Host(HostConfig(data_dir=tmp_path, warm_auto=0), engines=engines)
    try:
        assert h.replicas[0].suspender is not None and h.replicas[0].suspender.swapper is not None
        got = _run_all(h, h.compile(programs["pressure"]), arglists)
        want = [("completed", " ".join(str((int(a[-1]) + 1 + k) % 256) for k in range(57))) for a in arglists]
        assert got == want
        mem = h.stats()["memory"]
        assert mem["suspensions"] > 0 and mem["swap_used_bytes"] == 0
        wait_for(lambda: h.free_pages() == 24, 10)
    finally:
        h.shutdown()
