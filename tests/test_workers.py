"""Instance workers (HostConfig.workers, host/workers/): guests run in worker processes while the
scheduler, the pages and the backend stay in the host's process. These tests pin workers=2
whatever `--workers` the run has; the rest of the suite runs in either mode (`pytest --workers N`).

On the fake backend (each token the last one + 1), so every output is known independently."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from fakes import FakeBackend
from helpers import Run, text_completion_burst, wait_for, wasm_bytes

from host import Host, HostConfig
from host.cli.options import add_host_options, host_config_from_args
from host.config import auto_workers
from host.wasm import priority


def expected_generation(prompt: list[int], n: int) -> str:
    return " ".join(str(prompt[-1] + 1 + i) for i in range(n))


def make_host(tmp: Path, **config: object) -> Host:
    cfg = HostConfig(workers=2, data_dir=tmp, **config)  # type: ignore[arg-type]
    return Host(cfg, backend=FakeBackend(page_size=4, num_pages=256, delay_s=0.002))


def terminated_promptly(h: Host, run: Run, reason: str) -> None:
    """Terminate `run` while a call of its guest is served from the reader thread: it ends `aborted`
    with `reason` well before that call's job (1 s steps) would be done, and every page comes back."""
    t0 = time.monotonic()
    h.terminate(run.id, reason)
    end = run.finish(5)
    assert (end.event, end.message) == ("aborted", reason)
    assert time.monotonic() - t0 < 0.7  # (answered by terminate, not by the job's end)
    wait_for(lambda: h.free_pages() == h.total_pages, what="every page back")


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    h = make_host(tmp_path_factory.mktemp("data"), wall_budget_s=30.0)
    yield h
    h.shutdown()


@pytest.mark.build
def test_a_text_completion_burst_runs_in_both_workers_with_exact_outputs(host: Host) -> None:
    prog = host.compile(wasm_bytes("text_completion"))
    before = [w["launched"] for w in host.stats()["workers"]["per_worker"]]
    got, wants = text_completion_burst(host, prog, [f"{i:02d} lighthouses" for i in range(12)], 16)
    assert got == wants
    stats = host.stats()["workers"]
    assert stats["count"] == 2
    assert all(w["launched"] - b >= 4 for w, b in zip(stats["per_worker"], before, strict=True)), stats
    assert len({w["pid"] for w in stats["per_worker"]} | {os.getpid()}) == 3  # two processes of their own
    # every completion made host calls (generate-fresh, release) and the workers ran its guest
    assert sum(w["calls"] for w in stats["per_worker"]) >= 2 * 12
    assert all(w["cpu_s"] is None or w["cpu_s"] > 0 for w in stats["per_worker"])


def test_a_guest_bug_in_a_worker_traps_that_instance_only(host: Host) -> None:
    prog = host.compile(wasm_bytes("misbehave"))
    good = [Run(host, prog, ["generate", "12", str(10 + 7 * i), str(11 + 7 * i)]) for i in range(4)]
    bad = Run(host, prog, ["invalid_page"])
    end = bad.finish(60)
    assert end.event == "exception" and "page 1000000 is not held by this instance" in end.message
    for i, r in enumerate(good):
        e = r.finish(60)
        assert (e.event, e.message) == ("completed", expected_generation([11 + 7 * i], 12))
    wait_for(lambda: host.free_pages() == host.total_pages, what="every page back")


def test_terminate_stops_a_guest_computing_in_its_worker(host: Host) -> None:
    spin = Run(host, host.compile(wasm_bytes("loop")), [])
    wait_for(lambda: any(i["id"] == spin.id and i["state"] == "running" for i in host.instances()), what="running")
    host.terminate(spin.id, "stop spinning")
    end = spin.finish(20)
    assert (end.event, end.message) == ("aborted", "stop spinning")


@pytest.mark.heavy  # (~3 s; make test runs it)
def test_the_wall_budget_stops_a_guest_computing_in_its_worker(tmp_path: Path) -> None:
    h = make_host(tmp_path, wall_budget_s=0.5)
    try:
        end = Run(h, h.compile(wasm_bytes("loop")), []).finish(20)
        assert end.event == "exception" and "wall-clock budget of 0.5 s exceeded" in end.message
    finally:
        h.shutdown()


@pytest.mark.heavy  # (~6 s: a worker killed and restarted; make test runs it)
def test_a_killed_worker_ends_only_its_instances_and_is_replaced(tmp_path: Path) -> None:
    h = make_host(tmp_path, wall_budget_s=60.0)
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        runs = [Run(h, prog, ["hog", "2"]) for _ in range(8)]  # each holds 2 pages until told to go
        wait_for(lambda: h.free_pages() == h.total_pages - 16, what="every instance holding its pages")
        victim = h.workers.workers[0] if h.workers is not None else None
        assert victim is not None
        # (the least loaded worker takes each launch; a warm instance the pool started counts too)
        doomed = set(victim.instances) & {r.id for r in runs}
        assert 2 <= len(doomed) <= 6, (len(doomed), len(victim.instances))
        os.kill(victim.pid, signal.SIGKILL)
        for r in runs:
            if r.id in doomed:
                end = r.finish(30)
                assert end.event == "exception" and "worker process died" in end.message, end
        for r in runs:
            if r.id not in doomed:
                h.signal(r.id, "go")
                assert r.finish(30).event == "completed"
        wait_for(lambda: h.free_pages() == h.total_pages, what="the dead worker's instances' pages back")
        wait_for(lambda: h.stats()["workers"]["restarts"] == 1, what="the dead worker restarted")
        again = Run(h, prog, ["generate", "5", "3"]).finish(30)  # the host serves on, the new worker too
        assert (again.event, again.message) == ("completed", expected_generation([3], 5))
    finally:
        h.shutdown()


def test_workers_from_the_cli_and_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_host_options(p)
    assert host_config_from_args(p.parse_args(["--workers", "3"])).workers == 3
    auto = host_config_from_args(p.parse_args(["--workers", "auto"]))
    assert auto.workers == "auto" and auto.worker_count == auto_workers()
    for bad in ("-1", "x", "1000"):
        with pytest.raises(SystemExit):
            p.parse_args(["--workers", bad])
        assert "--workers" in capsys.readouterr().err
    with pytest.raises(ValueError, match="workers"):
        HostConfig(workers=-2)
    with pytest.raises(ValueError, match="workers"):
        HostConfig(workers="many")  # type: ignore[arg-type]


def test_auto_is_one_worker_per_core_up_to_eight_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [auto_workers(c) for c in (1, 2, 3, 8, 16, 64)] == [0, 2, 3, 8, 8, 8]
    monkeypatch.delenv("PIE_WORKERS")
    assert HostConfig().workers == "auto"
    monkeypatch.setenv("PIE_WORKERS", "auto")
    assert HostConfig().worker_count == auto_workers(len(os.sched_getaffinity(0)))
    monkeypatch.setenv("PIE_WORKERS", "3")
    assert HostConfig().workers == 3
    monkeypatch.setenv("PIE_WORKERS", "lots")
    with pytest.raises(ValueError, match="PIE_WORKERS"):
        HostConfig()


@pytest.mark.build
def test_streamed_pieces_sent_one_way_arrive_in_order_and_complete(host: Host) -> None:
    """`messaging.send` returns nothing: a worker sends it without waiting (host/workers/worker.py,
    ONEWAY), at most 32 unanswered at once. 48 streamed pieces arrive in order, before the end,
    and join into the return value; the arguments, the tokenizer and the return value are answered
    in the worker."""
    prog = host.compile(wasm_bytes("text_completion"))
    prompt = "one way"
    run = Run(host, prog, ["--prompt", prompt, "--max-tokens", "48", "--raw", "--stream"])
    end = run.finish(60)
    tok = host.backend.tokenizer
    last = tok.encode(prompt)[-1]
    want = tok.decode([(last + 1 + i) % host.backend.info.vocab_size for i in range(48)])
    assert (end.event, end.message) == ("completed", want)
    assert len(run.messages) > 32 and "".join(run.messages) == want


@pytest.mark.heavy  # (~5 s; make test runs it)
def test_a_worker_naming_another_workers_instance_is_stopped_and_that_instance_untouched(tmp_path: Path) -> None:
    """A worker only speaks for its own instances (another tenant's may run in the other): a
    message naming an instance it does not run stops that worker; the instance runs on."""
    from host.workers import wire

    h = make_host(tmp_path, wall_budget_s=60.0)
    try:
        assert h.workers is not None
        prog = h.compile(wasm_bytes("misbehave"))
        runs = [Run(h, prog, ["hog", "1"]) for _ in range(2)]  # one on each worker
        wait_for(lambda: all(len(w.instances) == 1 for w in h.workers.workers), what="one instance per worker")
        victim_worker, liar = h.workers.workers
        (victim,) = victim_worker.instances
        h.workers._message(liar, wire.Call(victim, "kv.release", ([0],)))  # as if the liar had sent it
        liar_run = next(r for r in runs if r.id != victim)
        end = liar_run.finish(30)
        assert end.event == "exception" and "worker process died" in end.message
        victim_run = next(r for r in runs if r.id == victim)
        h.signal(victim, "go")
        assert victim_run.finish(30).event == "completed"
    finally:
        h.shutdown()


@pytest.mark.build
def test_a_stepping_guests_steps_are_served_on_the_reader_thread_with_exact_tokens(host: Host) -> None:
    """`Context.decode_step` x 24 from a worker: after its first step (which makes its lookahead
    state on its host thread) the host's reader thread of that worker serves every step itself
    (`RemoteInstance.serve_now`); the tokens are the fake's (each the last + 1)."""
    prog = host.compile(wasm_bytes("misbehave"))
    before = sum(w["steps_on_reader"] for w in host.stats()["workers"]["per_worker"])
    end = Run(host, prog, ["generate", "24", "3", "1", "4"]).finish(60)
    assert (end.event, end.message) == ("completed", expected_generation([4], 24))
    after = sum(w["steps_on_reader"] for w in host.stats()["workers"]["per_worker"])
    assert after - before >= 22, (before, after)


@pytest.mark.build
def test_terminate_answers_a_step_served_on_the_reader_and_frees_its_pages(tmp_path: Path) -> None:
    """A guest stepping behind 1 s steps is terminated while its step, served from the reader thread,
    is queued or running: it ends `aborted` with the reason well before that step is done, every page
    comes back, and the worker goes on serving the next guest."""
    h = Host(HostConfig(workers=2, data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=256, delay_s=1.0))
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        run = Run(h, prog, ["generate", "800", "7"])
        wait_for(lambda: sum(w["steps_on_reader"] for w in h.stats()["workers"]["per_worker"]) >= 1,
                 what="a step served on the reader")
        terminated_promptly(h, run, "enough steps")
        end = Run(h, prog, ["generate", "2", "9"]).finish(30)
        assert (end.event, end.message) == ("completed", expected_generation([9], 2))
    finally:
        h.shutdown()


def _nice_threads(pid: int) -> dict[int, int]:
    """The nice value of each thread of process `pid` (Linux's /proc)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                out[int(tid)] = int(f.read().rsplit(")", 1)[1].split()[16])
        except (OSError, IndexError, ValueError):  # (a thread that ended meanwhile)
            pass
    return out


@pytest.mark.skipif(not priority.available(), reason="a lowered thread cannot be raised back here")
def test_a_warm_guest_in_a_worker_runs_in_the_background_until_its_launch(tmp_path: Path) -> None:
    """As in the host's process (HostConfig.warm_yield): a warm guest's thread in its worker runs at the
    lowest CPU priority while it is parked, so refills do not take the cores from a running burst,
    and at its launch it is raised back to the worker's priority."""
    h = make_host(tmp_path, max_instances=8, warm_auto=0)
    try:
        pid = h.stats()["workers"]["per_worker"][0]["pid"]
        base = os.getpriority(os.PRIO_PROCESS, pid)
        prog = h.compile(wasm_bytes("misbehave"))
        before = {t for t, n in _nice_threads(pid).items() if n == priority.BACKGROUND_NICE}
        assert h.prewarm(prog, 1) == 1
        parked = h.warm._ready[prog][0]
        parked_pid, parked_id = parked.worker.pid, parked.id  # type: ignore[union-attr]
        lowered = {t for t, n in _nice_threads(parked_pid).items() if n == priority.BACKGROUND_NICE}
        guests = lowered - (before if parked_pid == pid else set())
        assert guests, "no thread of the warm guest's worker runs in the background"
        with h.warm._cond:  # no refill after the launch below: only the launched guest's thread changes
            h.warm._target[prog] = 0
            h.warm._pinned.discard(prog)
        run = Run(h, prog, ["hog", "1"])
        assert run.id == parked_id
        assert run.events.get(timeout=30).message == "holding"
        nice = _nice_threads(parked_pid)
        raised = [t for t in guests if nice.get(t) == base]
        assert len(raised) == 1, (guests, nice)  # the launched guest serves a client now
        h.signal(run.id, "go")
        assert run.finish(30).message == "released"
    finally:
        h.shutdown()


def test_a_warm_start_in_a_worker_waits_for_the_reapers_frees_at_most_a_while(monkeypatch: pytest.MonkeyPatch) -> None:
    """`_Worker._await_frees` (a warm guest's `before_warm_store`): it returns once the worker's
    reaper has freed every store queued, and after `_FREES_WAIT_S` if it never does."""
    import threading

    from host.wasm.reaper import StoreReaper
    from host.workers import worker as worker_mod

    class Store:
        def __init__(self, gate: threading.Event) -> None:
            self.gate, self.closed = gate, False

        def close(self) -> None:
            self.gate.wait(5)
            self.closed = True

    release = threading.Event()
    reaper = StoreReaper(busy=lambda: False, background=False)
    try:
        stores = [Store(release) for _ in range(3)]
        for st in stores:
            reaper.put(st)
        threading.Timer(0.1, release.set).start()
        fake = SimpleNamespace(engine=SimpleNamespace(reaper=reaper))
        worker_mod._Worker._await_frees(fake)  # type: ignore[arg-type]
        assert all(st.closed for st in stores) and reaper.pending() == 0
        monkeypatch.setattr(worker_mod, "_FREES_WAIT_S", 0.05)
        stuck = threading.Event()
        reaper.put(Store(stuck))
        t0 = time.monotonic()
        worker_mod._Worker._await_frees(fake)  # type: ignore[arg-type]
        assert 0.05 <= time.monotonic() - t0 < 1.0
        stuck.set()
    finally:
        reaper.close()
    worker_mod._Worker._await_frees(SimpleNamespace(engine=SimpleNamespace(reaper=None)))  # type: ignore[arg-type]


@pytest.mark.build
def test_a_completions_generation_and_release_are_served_on_the_reader_thread(host: Host) -> None:
    """`text_completion` makes two host calls after its arguments: `forward.generate-fresh` and the
    one-way `kv.release`. Both are served by the worker's reader thread in the host (no wake-up of
    the instance's thread: `RemoteInstance.serve_now`), the generation answered from the answering
    thread when the loop ends; the outputs are the fake's, every page comes back."""
    prog = host.compile(wasm_bytes("text_completion"))
    per = host.stats()["workers"]["per_worker"]
    before, steps = sum(w["calls_on_reader"] for w in per), sum(w["steps_on_reader"] for w in per)
    got, wants = text_completion_burst(host, prog, [f"{i:02d} harbours" for i in range(10)], 12)
    assert got == wants
    per = host.stats()["workers"]["per_worker"]
    assert sum(w["calls_on_reader"] for w in per) - before >= 2 * 10
    assert sum(w["steps_on_reader"] for w in per) == steps  # (no decode step among them)
    wait_for(lambda: host.free_pages() == host.total_pages, what="every page back")


@pytest.mark.build
def test_terminate_answers_a_generation_served_on_the_reader_and_frees_its_pages(tmp_path: Path) -> None:
    """A completion behind 1 s steps is terminated while its host-side loop, begun from the reader
    thread, runs (the instance then counts as waiting, as in-process: no longer starting): it ends `aborted` with the reason well before the loop would end, the loop is
    cancelled (every page comes back), and the next completion runs exactly."""
    h = Host(HostConfig(workers=2, data_dir=tmp_path, warm_auto=0),
             backend=FakeBackend(page_size=4, num_pages=256, delay_s=1.0))
    try:
        prog = h.compile(wasm_bytes("text_completion"))
        run = Run(h, prog, ["--prompt", "a long story", "--max-tokens", "500"])
        wait_for(lambda: sum(w["calls_on_reader"] for w in h.stats()["workers"]["per_worker"]) >= 1,
                 what="a generation begun on the reader")
        # (it waits for its loop, as in-process: no longer counted as starting, so refills go on)
        wait_for(lambda: not h.starts.active(), 2, what="the launch no longer counted as starting")
        # (every call so far, its arguments and the generation's start, was served on the reader: the
        # instance has no thread in the host yet; `RemoteInstance.start` places it from the starter's)
        assert h._get(run.id)._job is None
        terminated_promptly(h, run, "enough of that story")
        h.backend.delay_s = 0.002
        got, wants = text_completion_burst(h, prog, ["a short one"], 3)
        assert got == wants
    finally:
        h.shutdown()


@pytest.mark.build
@pytest.mark.parametrize("finish_waits", [False, True], ids=["answered-on-the-answering-thread", "handed-to-the-instance-thread"])
def test_a_fresh_generation_ended_before_its_first_token_gives_its_pages_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, finish_waits: bool) -> None:
    """As a suspension does, every instance's first host-side loop is ended before its first token
    (`cancel("out-of-pages")` as it is queued): `generate-fresh`, begun on the reader thread, gives
    the loop's pages back before it answers (the SDK holds nothing new and starts again). Where
    giving them back would wait (the instance's pages are not free to touch: here every non-waiting
    gate is refused on the answering thread) the instance's thread does it and answers (`_Finish`).
    The outputs are exact and every page comes back."""
    from host.batching.scheduler import Scheduler
    from host.replicas import Replica
    from host.workers.remote import RemoteInstance

    ended: set[str] = set()
    submit = Scheduler.submit

    def submit_ending_first_loops(self: Scheduler, req: object, iid: str, *args: object, **kw: object) -> object:
        fut = submit(self, req, iid, *args, **kw)  # type: ignore[arg-type]
        gen = kw.get("generation")
        if gen is not None and iid not in ended:
            ended.add(iid)
            gen.cancel("out-of-pages")  # type: ignore[attr-defined]
        return fut

    monkeypatch.setattr(Scheduler, "submit", submit_ending_first_loops)
    finished: list[str] = []
    if finish_waits:
        gate_now, finish = Replica.gate_now, RemoteInstance._finish

        def no_gate_on_answers(self: Replica, inst: object) -> object:
            return None if threading.current_thread().name.endswith("-answers") else gate_now(self, inst)  # type: ignore[arg-type]

        def counted(self: RemoteInstance, msg: object) -> object:
            finished.append(self.id)
            return finish(self, msg)  # type: ignore[arg-type]

        monkeypatch.setattr(Replica, "gate_now", no_gate_on_answers)
        monkeypatch.setattr(RemoteInstance, "_finish", counted)
    h = Host(HostConfig(workers=2, data_dir=tmp_path, warm_auto=0),
             backend=FakeBackend(page_size=4, num_pages=256, delay_s=0.002))
    try:
        prog = h.compile(wasm_bytes("text_completion"))
        got, wants = text_completion_burst(h, prog, [f"{i:02d} ferries" for i in range(6)], 8)
        assert got == wants
        assert len(ended) >= 6
        assert len(finished) >= (6 if finish_waits else 0)
        assert sum(w["calls_on_reader"] for w in h.stats()["workers"]["per_worker"]) >= 2 * 6
        wait_for(lambda: h.free_pages() == h.total_pages, what="every page back")
    finally:
        h.shutdown()


@pytest.mark.build
def test_a_completion_whose_thread_cannot_start_at_its_end_fails_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold launch's thread in the host starts only when something needs it (its end, here): when
    no thread can be made then, that instance ends with the reason and its pages come back; the
    host goes on serving the next completion."""
    from host.workers import remote

    h = Host(HostConfig(workers=2, data_dir=tmp_path, warm_auto=0),
             backend=FakeBackend(page_size=4, num_pages=256, delay_s=0.002))
    try:
        prog = h.compile(wasm_bytes("text_completion"))
        with monkeypatch.context() as m:
            def no_thread(*_a: object, **_k: object) -> None:
                raise RuntimeError("can't start new thread")

            m.setattr(remote.threads, "run", no_thread)
            end = Run(h, prog, ["--prompt", "a lighthouse", "--max-tokens", "4"]).finish(30)
        assert end.event == "exception" and "could not start the instance's thread: can't start new thread" in end.message
        wait_for(lambda: h.free_pages() == h.total_pages, what="every page back")
        got, wants = text_completion_burst(h, prog, ["a harbour"], 4)
        assert got == wants
        assert sum(w["instances"] for w in h.stats()["workers"]["per_worker"]) == 0
    finally:
        h.shutdown()
