"""Instance logs (issue 54): `runtime.log`, stdout and stderr kept in a bounded ring per instance,
streamed to the client as `log` events, readable after the instance ends (`Host.logs`, the
protocol's `logs` query), printed by `pie-run`; with `pytest --workers N`, from worker processes."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes import FakeBackend
from helpers import wait_for, wasm_bytes
from server_support import running_server

from host import Host, HostConfig
from host import host as host_mod
from host.client import PieClient, PieError
from host.events import InstanceEvent
from host.wasm import logs as logs_mod

pytestmark = pytest.mark.build


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    h = Host(HostConfig(data_dir=tmp_path_factory.mktemp("logs")), backend=FakeBackend(page_size=4, num_pages=64))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def prog(host: Host) -> str:
    return host.compile(wasm_bytes("chatty"))


def _run(host: Host, prog: str, args: list[str], tenant: str = "local") -> tuple[str, list[InstanceEvent]]:
    events: queue.Queue[InstanceEvent] = queue.Queue()
    iid = host.launch(prog, args, events.put, tenant=tenant)
    got = []
    while not (ev := events.get(timeout=60)).terminal:
        got.append(ev)
    return iid, [*got, ev]


def test_output_and_log_lines_are_streamed_and_kept(host: Host, prog: str) -> None:
    iid, events = _run(host, prog, ["lines", "3"])
    assert events[-1].event == "completed" and events[-1].message == "done"
    logged = [(e.stream, e.message) for e in events if e.event == "log"]
    assert [m for s, m in logged if s == "stdout"] == ["out 0", "out 1", "out 2", "no newline"]
    assert ("stderr", "err line") in logged and ("log", "log line") in logged
    assert not [e for e in events if e.event == "message"]  # log lines are not the inferlet's messages
    kept = host.logs(iid)
    assert kept is not None
    assert sorted((e["stream"], e["text"]) for e in kept) == sorted(logged)
    assert all(isinstance(e["t"], float) for e in kept)


def test_logs_are_the_tenants_own(host: Host, prog: str) -> None:
    iid, _ = _run(host, prog, ["lines", "1"], tenant="alice")
    assert host.logs(iid, "alice") and host.logs(iid) is not None
    assert host.logs(iid, "bob") is None
    assert host.logs("no-such-instance") is None


def test_a_running_instances_log_is_readable(host: Host, prog: str) -> None:
    events: queue.Queue[InstanceEvent] = queue.Queue()
    iid = host.launch(prog, ["wait"], events.put)
    wait_for(lambda: bool(host.logs(iid)), what="the first line")
    assert [e["text"] for e in host.logs(iid) or []] == ["waiting"]
    host.signal(iid, "go")
    assert host.wait(iid, 30)


def test_a_failed_instances_log_outlives_it(host: Host, prog: str) -> None:
    iid, events = _run(host, prog, ["crash"])
    assert events[-1].event == "exception" and "on purpose" in events[-1].message
    assert [(e["stream"], e["text"]) for e in host.logs(iid) or []] == [("stdout", "about to fail")]


def test_an_ended_instances_log_is_kept_for_the_retention_time_only(host: Host, prog: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Readable, and listed by `Host.ended_instances` (the dashboard's "recently ended"), until
    LOG_RETENTION_S after its end; then it reads as unknown and is no longer listed."""
    iid, _ = _run(host, prog, ["lines", "2"], tenant="alice")
    listed = {i["id"]: i for i in host.ended_instances()}
    assert listed[iid]["tenant"] == "alice" and listed[iid]["state"] == "completed"
    assert listed[iid]["log_lines"] == len(host.logs(iid) or []) > 0
    assert host.ended_instances()[0]["id"] == iid  # the newest first
    monkeypatch.setattr(host_mod, "LOG_RETENTION_S", 0.05)
    time.sleep(0.1)
    assert host.logs(iid) is None and host.logs(iid, "alice") is None
    assert iid not in {i["id"] for i in host.ended_instances()}


def test_the_ring_and_the_stream_are_bounded(host: Host, prog: str) -> None:
    n, size = 1500, 1000  # 1.5 MB printed: more than the ring and the streamed bound
    iid, events = _run(host, prog, ["flood", str(n), str(size)])
    assert events[-1].event == "completed"
    streamed = [e.message for e in events if e.event == "log"]
    assert streamed[-1].startswith("[the instance's log passed")  # one note, then nothing more
    assert sum(len(m) for m in streamed[:-1]) <= logs_mod.MAX_STREAMED + size + 10
    kept = host.logs(iid) or []
    assert len(kept) <= logs_mod.MAX_LINES and sum(len(e["text"]) for e in kept) <= logs_mod.MAX_BYTES
    if not host.config.worker_count:  # (the worker streams what the host keeps: up to its bound)
        assert kept[-1]["text"].startswith(f"{n - 1:06d}")  # the ring keeps the newest lines


def test_unit_partial_lines_and_cut_lines() -> None:
    log = logs_mod.InstanceLog()
    assert log.write("stdout", b"ab") == [] and log.write("stdout", b"c\nd\r\ne") == ["abc", "d"]
    assert log.flush() == [("stdout", "e")] and log.flush() == []
    long = "y" * (logs_mod.MAX_LINE + 5)
    assert log.add("log", long) == "y" * logs_mod.MAX_LINE + " [cut]"


def test_the_protocol_streams_log_events_and_answers_the_logs_query(tmp_path: Path) -> None:
    with Host(HostConfig(data_dir=tmp_path / "h"), backend=FakeBackend(page_size=4, num_pages=64)) as h, \
            running_server(tmp_path / "s", h, auth_token="admin", tenants=(("alice", "ta"), ("bob", "tb"))) as srv:
        async def main() -> None:
            async with (await PieClient.connect(srv.url, token="ta") as alice,
                        await PieClient.connect(srv.url, token="tb") as bob):
                prog = await alice.upload_program(wasm_bytes("chatty"))
                iid = await alice.launch(prog, ["lines", "2"])
                events = [e async for e in alice.events(iid)]
                assert [(e.stream, e.message) for e in events if e.event == "log"][:2] == \
                    [("stdout", "out 0"), ("stdout", "out 1")]
                lines = await alice.logs(iid)
                assert [x["text"] for x in lines if x["stream"] == "stdout"] == ["out 0", "out 1", "no newline"]
                with pytest.raises(PieError, match="unknown instance"):
                    await bob.logs(iid)
                with pytest.raises(PieError, match="record must be an instance id"):
                    await bob.query("logs", 7)

        asyncio.run(main())


def test_pie_run_prints_log_lines_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from host.client.remote import run_remote

    wasm = tmp_path / "chatty.wasm"
    wasm.write_bytes(wasm_bytes("chatty"))
    with Host(HostConfig(data_dir=tmp_path / "h"), backend=FakeBackend(page_size=4, num_pages=64)) as h, \
            running_server(tmp_path / "s", h) as srv:
        assert run_remote(srv.url, wasm, ["lines", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "done"  # stdout: the inferlet's messages and return value only
    assert "[stdout] out 0\n[stdout] out 1\n" in err and "[stderr] err line" in err and "[log] log line" in err


def test_embedded_pie_run_prints_log_lines_on_stderr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """pie-run without --server (its own host; here on the stand-in)."""
    import dataclasses

    import host as host_pkg
    from host.cli import run as pie_run

    real = host_pkg.Host
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(pie_run, "_pump_stdin", lambda send, close: None)  # (no stdin to forward)
    monkeypatch.setattr(host_pkg, "Host", lambda config: real(dataclasses.replace(config, warm_auto=0),
                                                              backend=FakeBackend(page_size=4, num_pages=64)))
    wasm = tmp_path / "chatty.wasm"
    wasm.write_bytes(wasm_bytes("chatty"))
    assert pie_run.main([str(wasm), "--", "lines", "2"]) == pie_run.EXIT_OK
    out, err = capsys.readouterr()
    assert out.strip() == "done"
    assert "[stdout] out 0\n[stdout] out 1\n" in err and "[stderr] err line" in err and "[log] log line" in err
