"""Record and replay (host/replay/, docs/observability.md): a recorded instance's host calls come
back identical when its guest is replayed without a model, a changed guest diverges at the first
call it changes, recordings are bounded and a tenant's own, and `pie-run --record` writes files
`pie-replay` reads. The standard inferlets' recorded fixtures (tests/fixtures/recordings/, made by
its refresh.py on the real model) must replay identically against the inferlets as built now."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import wasmtime
from fakes import FakeBackend
from helpers import FIXTURES, wasm_bytes
from server_support import running_server

from host import Host, HostConfig
from host.api import fastcall
from host.cli import run as pie_run
from host.cli.build import standard_inferlets
from host.client import PieClient, PieError
from host.client import protocol as p
from host.replay import cli
from host.replay.format import Call, load
from host.replay.replay import Outcome, replay
from host.workers import wire

RECORDINGS = FIXTURES / "recordings"
STANDARD = tuple(standard_inferlets())  # every one has a fixture: a new one without fails below
PROBE = (FIXTURES / "replay_probe.wat").read_text()
LAST = "(call $set (i32.const 3)) ;; LAST"
PROBE_CALLS = [Call("runtime.set-priority", [-7], True, None), Call("runtime.priority", [], True, -7),
               Call("runtime.set-priority", [3], True, None)]


def _probe(last: str = LAST) -> bytes:
    """The probe component, its last call replaced by `last` (a changed guest)."""
    assert LAST in PROBE
    return bytes(wasmtime.wat2wasm(PROBE.replace(LAST, last)))


def _host(tmp_path: Path, workers: int | None = None, **config: object) -> Host:
    """A host on the stand-in; `workers` None: the suite's mode (pytest --workers N)."""
    if workers is not None:
        config["workers"] = workers
    return Host(HostConfig(data_dir=tmp_path, warm_auto=0, **config),  # type: ignore[arg-type]
                backend=FakeBackend())  # (compiled components in the usual cache: compiled once)


def _record(host: Host, wasm: bytes, args: tuple[str, ...] = ()) -> bytes:
    iid = host.launch(host.compile(wasm), list(args), record=True)
    assert host.wait(iid, 60)
    data = host.recording(iid)
    assert data is not None
    return data


def _replay(host: Host, data: bytes, wasm: bytes) -> Outcome:
    return replay(load(data), host.wasm.get(host.compile(wasm)), host.wasm.engine)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    h = _host(tmp_path_factory.mktemp("replay"))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def probe_recording(host: Host) -> bytes:
    return _record(host, _probe())


# ---- recording, and replaying the same guest ----

@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.heavy)])  # 2: heavy, worker processes (~2-4 s)
def test_a_recording_replays_identically_in_process_and_with_workers(tmp_path: Path, workers: int) -> None:
    """Every call, its arguments and result, in order, in both modes; then the same guest replays them."""
    with _host(tmp_path, workers) as h:
        data = _record(h, _probe())
        rec = load(data)
        assert (rec.calls, rec.end, rec.truncated) == (PROBE_CALLS, ("completed", ""), False)
        assert rec.program == h.compile(_probe()) and rec.tenant == "local" and rec.model == h.model_name
        out = _replay(h, data, _probe())
        assert (out.identical, out.replayed, out.end, out.truncated) == (True, 3, ("completed", ""), False)


@pytest.mark.heavy  # (~6 s: worker processes; make test runs it)
def test_a_trapped_call_is_recorded_the_same_with_workers_and_replayed(tmp_path: Path) -> None:
    """set-priority(5000) traps (a one-way call in a worker: a recorded guest waits for its answer, so
    it sees the trap at that call, as in-process); the replay raises the recorded trap again."""
    ends = []
    for workers in (0, 2):
        with _host(tmp_path / str(workers), workers) as h:
            data = _record(h, wasm_bytes("set_priority"))
            rec = load(data)
            assert [c.name for c in rec.calls] == ["runtime.set-priority", "runtime.priority", "runtime.set-priority"]
            assert rec.calls[2].ok is False and "got 5000" in rec.calls[2].value
            out = _replay(h, data, wasm_bytes("set_priority"))
            assert out.identical and out.end == rec.end
            ends.append((rec.calls, rec.end))
    assert ends[0] == ends[1] and ends[0][1][0] == "exception"


@pytest.mark.build
@pytest.mark.parametrize(("name", "args", "call"), [
    ("text_completion", ("--prompt", "hi", "--max-tokens", "5"), "forward.generate-fresh"),
    ("constrained_json", ("--max-tokens", "8"), "grammar.[method]grammar.matcher"),  # resource handles both ways
])
def test_standard_inferlets_round_trip_on_the_stand_in_in_both_modes(tmp_path: Path, name: str,
                                                                      args: tuple[str, ...], call: str) -> None:
    """Records, token lists, the chat template, resource handles: the same calls in process and in a
    worker, and each replays identically. (On the stand-in constrained_json ends with an error: the
    stand-in draws its token without the grammar's mask; what matters is that the replay agrees.)"""
    wasm = wasm_bytes(name)
    calls = []
    for workers in (0, 2):
        with _host(tmp_path / str(workers), workers) as h:
            data = _record(h, wasm, args)
            rec = load(data)
            assert call in [c.name for c in rec.calls] and rec.end is not None
            out = _replay(h, data, wasm)
            assert out.identical and out.replayed == len(rec.calls) and out.end == rec.end
            calls.append(wire.dumps([[c.name, c.args, c.ok, c.value] for c in rec.calls] + [rec.end]))
    assert calls[0] == calls[1]  # (compared encoded: handles are objects)


# A guest that reads the monotonic clock, sleeps 20 ms in WASI (as a Python guest's time.sleep) and
# sets its priority to the milliseconds it saw pass, capped at 9: the host's clock is a host call.
CLOCK_PROBE = """
(component
  (import "wasi:io/poll@0.2.0" (instance $poll
    (export "pollable" (type $p (sub resource)))
    (export "[method]pollable.block" (func (param "self" (borrow $p))))))
  (alias export $poll "pollable" (type $pollable))
  (import "wasi:clocks/monotonic-clock@0.2.0" (instance $clock
    (alias outer 1 $pollable (type $p))
    (export "pollable" (type (eq $p)))
    (export "now" (func (result u64)))
    (export "subscribe-duration" (func (param "when" u64) (result (own $p))))))
  (import "pie:inferlet/runtime@0.4.0" (instance $rt (export "set-priority" (func (param "priority" s32)))))
  (alias export $clock "now" (func $now))
  (alias export $clock "subscribe-duration" (func $sub))
  (alias export $poll "[method]pollable.block" (func $block))
  (alias export $rt "set-priority" (func $set))
  (core func $now_lowered (canon lower (func $now)))
  (core func $sub_lowered (canon lower (func $sub)))
  (core func $block_lowered (canon lower (func $block)))
  (core func $set_lowered (canon lower (func $set)))
  (core module $m
    (import "env" "now" (func $now (result i64)))
    (import "env" "sub" (func $sub (param i64) (result i32)))
    (import "env" "block" (func $block (param i32)))
    (import "env" "set" (func $set (param i32)))
    (memory (export "mem") 1)
    (func (export "run") (result i32) (local $t0 i64) (local $ms i64)
      (local.set $t0 (call $now))
      (call $block (call $sub (i64.const 20000000)))
      (local.set $ms (i64.div_u (i64.sub (call $now) (local.get $t0)) (i64.const 1000000)))
      (if (i64.gt_u (local.get $ms) (i64.const 9)) (then (local.set $ms (i64.const 9))))
      (call $set (i32.wrap_i64 (local.get $ms)))
      i32.const 0))
  (core instance $i (instantiate $m (with "env" (instance
    (export "now" (func $now_lowered)) (export "sub" (func $sub_lowered))
    (export "block" (func $block_lowered)) (export "set" (func $set_lowered))))))
  (func (export "run") (result (result (error string)))
    (canon lift (core func $i "run") (memory (core memory $i "mem")))))
"""


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.heavy)])  # 2: heavy, worker processes
def test_the_hosts_clock_is_recorded_and_replayed_from_the_recording(tmp_path: Path, workers: int) -> None:
    """now() and the sleep are recorded host calls; the replay gives back the recorded times (not its
    own: a doctored recording in which 3 ms passed replays identically against set-priority(3)) and
    does not sleep."""
    wasm = bytes(wasmtime.wat2wasm(CLOCK_PROBE))
    with _host(tmp_path, workers) as h:
        data = _record(h, wasm)
        rec = load(data)
        assert [c.name for c in rec.calls] == ["monotonic-clock.now", "monotonic-clock.subscribe-duration",
                                               "monotonic-clock.now", "runtime.set-priority"]
        t0, t1 = rec.calls[0].value, rec.calls[2].value
        assert t1 - t0 >= 20_000_000 and rec.calls[1] == Call("monotonic-clock.subscribe-duration",
                                                              [20_000_000], True, None)
        assert rec.calls[3].args == [9] and rec.end == ("completed", "")
        assert _replay(h, data, wasm).identical
        calls = list(rec.calls)
        calls[2] = dataclasses.replace(calls[2], value=t0 + 3_400_000)
        calls[3] = dataclasses.replace(calls[3], args=[3])
        out = replay(dataclasses.replace(rec, calls=calls), h.wasm.get(h.compile(wasm)), h.wasm.engine)
        assert out.identical and out.replayed == 4
        calls[3] = dataclasses.replace(calls[3], args=[9])  # (the times the guest saw decide its call)
        out = replay(dataclasses.replace(rec, calls=calls), h.wasm.get(h.compile(wasm)), h.wasm.engine)
        assert out.divergence is not None and out.divergence.guest == ("runtime.set-priority", [3])


# ---- a changed guest diverges ----

@pytest.mark.parametrize(("last", "position", "reason", "guest"), [
    ("(call $set (i32.const 4)) ;; LAST", 2, "different arguments (argument 1 differs)",
     ("runtime.set-priority", [4])),
    ("(drop (call $get)) ;; LAST", 2, "a different call", ("runtime.priority", [])),
    (f"{LAST}\n      (call $set (i32.const 5))", 3, "after the recording's last (3 calls)",
     ("runtime.set-priority", [5])),
    (";; no last call", 2, "ended (completed: ) after 2 of the 3 recorded calls", None),
])
def test_a_changed_guest_diverges_at_its_first_different_call(host: Host, probe_recording: bytes, last: str,
                                                              position: int, reason: str,
                                                              guest: tuple[str, list[int]] | None) -> None:
    out = _replay(host, probe_recording, _probe(last))
    d = out.divergence
    assert d is not None and not out.identical
    assert (d.position, d.guest) == (position, guest) and reason in d.reason
    assert d.recorded == (PROBE_CALLS[position] if position < 3 else None)


def test_a_different_end_is_a_divergence(host: Host, probe_recording: bytes, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    """Same calls, but then the guest traps instead of completing."""
    changed = PROBE.replace(f"{LAST}\n      i32.const 0))", f"{LAST}\n      unreachable))")
    assert changed != PROBE
    out = _replay(host, probe_recording, bytes(wasmtime.wat2wasm(changed)))
    assert out.divergence is not None and out.replayed == 3
    assert "ended differently: recorded completed: ; replayed exception: trap" in out.divergence.reason
    rec, wasm = tmp_path / "probe.rec", tmp_path / "trapping.wasm"
    rec.write_bytes(probe_recording)
    wasm.write_bytes(bytes(wasmtime.wat2wasm(changed)))
    assert cli.main([str(rec), str(wasm)]) == cli.EXIT_DIVERGED
    assert "diverged at the end, after all 3 recorded calls (identical)" in capsys.readouterr().out


def test_the_cli_reports_the_divergence_and_exits_1(host: Host, probe_recording: bytes, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rec, wasm = tmp_path / "probe.rec", tmp_path / "changed.wasm"
    rec.write_bytes(probe_recording)
    wasm.write_bytes(_probe("(call $set (i32.const 4)) ;; LAST"))
    args = ["--cache-dir", str(host.config.cache_dir)]
    assert cli.main([str(rec), *args]) == cli.EXIT_IDENTICAL  # (found in the cache by its hash)
    assert "replayed 3 calls: identical" in capsys.readouterr().out
    assert cli.main([str(rec), str(wasm), *args]) == cli.EXIT_DIVERGED
    out = capsys.readouterr().out
    assert "diverged at call 3 of 3 (position 2" in out and "argument 1 differs" in out
    assert "recorded: runtime.set-priority(3) -> None" in out and "guest:    runtime.set-priority(4)" in out


# ---- bounds and isolation ----

@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.heavy)])  # 2: heavy, worker processes (~2-4 s)
def test_a_recording_past_its_bound_is_truncated_and_the_instance_runs_on(tmp_path: Path, workers: int,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    with _host(tmp_path, workers, max_recording_bytes=64) as h:
        data = _record(h, _probe())
        rec = load(data)
        assert rec.truncated and rec.calls == PROBE_CALLS[:len(rec.calls)] and 0 < len(rec.calls) < 3
        assert rec.end == ("completed", "")  # it ran to its end
        out = _replay(h, data, _probe())
        assert out.identical and out.truncated and out.replayed == len(rec.calls)
        path = tmp_path / "cut.rec"
        path.write_bytes(data)
        assert cli.main([str(path), "--cache-dir", str(h.config.cache_dir)]) == cli.EXIT_IDENTICAL
        assert "identical up to the end of the truncated recording" in capsys.readouterr().out


def test_only_recorded_instances_are_recorded_and_the_tap_goes_off(host: Host) -> None:
    """While one instance records (blocked in receive), another's calls are not in its recording; a
    launch without `record` has none; once no instance records, calls go straight to the imports."""
    waiting = host.launch(host.compile(wasm_bytes("blocked_receive")), [], record=True)
    assert (fastcall._tap is not None) == (host.workers is None)  # (with workers: tapped in the worker)
    plain = host.launch(host.compile(_probe()), [])
    assert host.wait(plain, 30) and host.recording(plain) is None
    host.close_input(waiting)
    assert host.wait(waiting, 30)
    rec = load(host.recording(waiting) or b"")
    assert [(c.name, c.args, c.value) for c in rec.calls] == [("messaging.receive", [None], None)]
    assert fastcall._tap is None and host.recording(waiting, tenant="someone-else") is None


def test_a_recorded_launch_that_waits_in_the_launch_queue_is_recorded(tmp_path: Path) -> None:
    with _host(tmp_path, max_instances=1) as h:
        busy = h.launch(h.compile(wasm_bytes("blocked_receive")), [])
        queued = h.launch(h.compile(_probe()), [], record=True)
        assert h.instances()[-1]["state"] == "queued"
        h.close_input(busy)
        assert h.wait(queued, 30)
        assert load(h.recording(queued) or b"").calls == PROBE_CALLS


# ---- the protocol and the CLIs ----

def test_the_protocol_serves_a_tenants_recordings_to_it_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(p, "RECORDING_CHUNK", 100)  # (the client reads it back in pieces)
    with _host(tmp_path / "host") as h, \
            running_server(tmp_path, host=h, auth_token="admin", tenants=(("alice", "ta"), ("bob", "tb"))) as srv:
        async def main() -> None:
            async with (await PieClient.connect(srv.url, token="ta") as alice,
                        await PieClient.connect(srv.url, token="tb") as bob):
                program = await alice.ensure_program(_probe())
                iid = await alice.launch(program, [], record=True)
                with pytest.raises(PieError, match="no recording of instance"):  # (not ended yet, or ended)
                    await bob.recording(iid)
                assert [e.event async for e in alice.events(iid)] == ["completed"]
                data = await alice.recording(iid)
                assert len(data) > 100 and data == h.recording(iid) and load(data).calls == PROBE_CALLS
                with pytest.raises(PieError, match="no recording of instance"):  # another tenant's
                    await bob.recording(iid)
                plain = await alice.launch(program, [])
                assert [e.event async for e in alice.events(plain)] == ["completed"]
                with pytest.raises(PieError, match="no recording of instance"):  # not recorded
                    await alice.recording(plain)
                with pytest.raises(PieError, match="field 'record' must be a boolean"):
                    await alice._request({"type": "launch_instance", "program_hash": program, "arguments": [],
                                          "record": "yes"})
                with pytest.raises(PieError, match="query recording: record must be an instance id"):
                    await alice.query("recording", 7)

        asyncio.run(main())


def _probe_file(tmp_path: Path) -> Path:
    path = tmp_path / "probe.wasm"
    path.write_bytes(_probe())
    return path


def test_pie_run_record_writes_a_file_pie_replay_accepts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The embedded pie-run on the stand-in (its Host swapped for one with FakeBackend)."""
    import host as host_pkg

    real = host_pkg.Host
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pie_run, "_pump_stdin", lambda send, close: None)  # (no stdin to forward)
    monkeypatch.setattr(host_pkg, "Host", lambda config: real(dataclasses.replace(config, warm_auto=0),
                                                              backend=FakeBackend()))
    out = tmp_path / "run.rec"
    assert pie_run.main([str(_probe_file(tmp_path)), "--record", str(out)]) == pie_run.EXIT_OK
    assert f"recorded the inferlet's host calls in {out}" in capsys.readouterr().err
    assert load(out.read_bytes()).calls == PROBE_CALLS
    assert cli.main([str(out)]) == cli.EXIT_IDENTICAL  # (its program found in the cache pie-run compiled it to)
    assert "replayed 3 calls: identical" in capsys.readouterr().out


def test_pie_run_server_record_writes_the_recording(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # (pie-run forwards stdin as signals)
    with _host(tmp_path / "host") as h, running_server(tmp_path, host=h) as srv:
        out = tmp_path / "remote.rec"
        assert pie_run.main([str(_probe_file(tmp_path)), "--server", srv.url, "--record", str(out)]) == 0
        assert f"recorded the inferlet's host calls in {out}" in capsys.readouterr().err
        rec = load(out.read_bytes())
        assert rec.calls == PROBE_CALLS and rec.end == ("completed", "")
        assert cli.main([str(out), str(_probe_file(tmp_path)), "--cache-dir", str(tmp_path / "cache")]) == 0


@pytest.mark.heavy  # (~1-2 s: a pie-replay subprocess; make test runs it)
def test_pie_replay_runs_as_a_command_without_torch(host: Host, probe_recording: bytes, tmp_path: Path) -> None:
    path = tmp_path / "probe.rec"
    path.write_bytes(probe_recording)
    cache = str(host.config.cache_dir)
    script = Path(sys.executable).parent / "pie-replay"
    done = subprocess.run([str(script), str(path), "--cache-dir", cache], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "replayed 3 calls: identical" in done.stdout, done.stderr
    check = ("import sys; from host.replay.cli import main; rc = main(sys.argv[1:]); "
             "assert 'torch' not in sys.modules, 'pie-replay imported torch'; sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", check, str(path), "--cache-dir", cache], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def _cut(data: bytes) -> bytes:
    return data[: len(data) // 2]


@pytest.mark.parametrize(("make", "message"), [
    (lambda rec: b"", "the file is empty"),
    (lambda rec: b"hello, not a recording", "not a pie recording"),
    (lambda rec: msgpack.packb([1, 2]), "not a pie recording: no \"format\""),
    (_cut, "cut short"),
    (lambda rec: msgpack.packb({"format": "pie-recording", "version": 2}), "version 2 is not one this pie-replay reads"),
    (lambda rec: msgpack.packb({"format": "pie-recording", "version": 1, "program": "ab", "calls": [["x"]]}),
     "call 0 of the recording is not [name, args, ok, value]"),
])
def test_bad_input_exits_2_with_a_message_and_no_traceback(probe_recording: bytes, tmp_path: Path, make: object,
                                                           message: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.rec"
    path.write_bytes(make(probe_recording))  # type: ignore[operator]
    assert cli.main([str(path)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.startswith("pie-replay: ")


def test_a_program_nowhere_to_be_found_is_a_clear_error(probe_recording: bytes, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "probe.rec"
    path.write_bytes(probe_recording)
    assert cli.main([str(path), "--cache-dir", str(tmp_path / "empty")]) == cli.EXIT_BAD_INPUT
    assert "pass PROGRAM.wasm" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "missing.rec")]) == cli.EXIT_BAD_INPUT
    assert "cannot read" in capsys.readouterr().err


# ---- the standard inferlets' recorded fixtures (recorded on the real model by refresh.py) ----

@pytest.mark.build
@pytest.mark.parametrize("name", STANDARD)
def test_the_standard_inferlets_replay_their_fixtures_identically(name: str, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = RECORDINGS / f"{name}.rec"
    refresh = f"(refresh it, if the inferlet changed on purpose: .venv/bin/python {RECORDINGS / 'refresh.py'} {name})"
    assert path.is_file(), f"the standard inferlet {name} has no recorded fixture {path} {refresh}"
    rec = load(path.read_bytes())
    assert path.stat().st_size < 200 * 1024 and rec.program_name == name and rec.end is not None
    assert rec.end[0] == "completed" and not rec.truncated and rec.arguments
    # (image_qa's is recorded on a tiny random LLaVA: the default model has no vision tower)
    assert rec.model.lower().startswith("llava" if name == "image_qa" else "smollm2")
    wasm = tmp_path / f"{name}.wasm"
    wasm.write_bytes(wasm_bytes(name))  # built from inferlets/ as it is now
    assert cli.main([str(path), str(wasm)]) == cli.EXIT_IDENTICAL, f"{capsys.readouterr().out}{refresh}"
    assert f"replayed {len(rec.calls)} calls: identical" in capsys.readouterr().out


@pytest.mark.build
def test_a_fixture_replayed_against_another_inferlet_diverges(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """text_completion's recording against beam_search: the same first five calls (stop tokens, chat
    template, arguments, the chat applied, encoded); then beam_search does not generate on the host."""
    wasm = tmp_path / "beam_search.wasm"
    wasm.write_bytes(wasm_bytes("beam_search"))
    path = RECORDINGS / "text_completion.rec"
    assert cli.main([str(path), str(wasm)]) == cli.EXIT_DIVERGED
    out = capsys.readouterr().out
    assert f"diverged at call 6 of {len(load(path.read_bytes()).calls)} (position 5" in out
    assert "recorded: forward.generate-fresh([" in out and "guest:    forward.generate-fresh" not in out


@pytest.mark.slow
@pytest.mark.build
def test_pie_run_records_on_the_real_model_and_pie_replay_says_identical(tmp_path: Path) -> None:
    """The two commands end to end, as a user runs them (the default model on CPU)."""
    bin_dir, out = Path(sys.executable).parent, tmp_path / "tc.rec"
    done = subprocess.run([str(bin_dir / "pie-run"), "text_completion", "--device", "cpu", "--record", str(out),
                           "--", "--prompt", "Hi", "-n", "4"], capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0 and f"recorded the inferlet's host calls in {out}" in done.stderr, done.stderr
    rec = load(out.read_bytes())
    assert rec.program_name == "text_completion" and rec.end is not None and rec.end[0] == "completed"
    assert rec.end[1].strip() == done.stdout.strip()  # (pie-run printed the return value)
    done = subprocess.run([str(bin_dir / "pie-replay"), str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"replayed {len(rec.calls)} calls: identical" in done.stdout, done.stderr


@pytest.mark.build
def test_without_a_program_the_standard_inferlet_the_recording_names_is_replayed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A program hash not in the compiled cache: the recording's `program_name` is built and replayed."""
    doc = msgpack.unpackb((RECORDINGS / "text_completion.rec").read_bytes(), raw=False)
    doc["program"] = "f" * 64
    path = tmp_path / "elsewhere.rec"
    path.write_bytes(msgpack.packb(doc, use_bin_type=True))
    assert cli.main([str(path)]) == cli.EXIT_IDENTICAL
    out = capsys.readouterr().out
    assert "calls: identical" in out and "note: replaying text_completion (sha256" in out
