"""The Python client: sync wrapper, run_remote (pie-run --server), connection loss."""

from __future__ import annotations

import asyncio
import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from server_support import WASM, FakeHost, running_server

from host.client import ConnectionLost, PieClient, PieError, SyncPieClient, run_remote


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(total_pages=32)


@pytest.fixture
def server(tmp_path: Path, host: FakeHost):
    with running_server(tmp_path / "data", host=host) as srv:
        yield srv


@pytest.fixture
def wasm_file(tmp_path: Path) -> Path:
    path = tmp_path / "app.wasm"
    path.write_bytes(WASM)
    return path


def _run(server, wasm_file: Path, args: list[str], **kw) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run_remote(server.url, wasm_file, args, **kw)
    return code, out.getvalue(), err.getvalue()


def test_sync_client_round_trip(server, host) -> None:
    with SyncPieClient(server.url) as client:
        assert client.ping() >= 0
        h = client.ensure_program(WASM)
        assert client.program_exists(h)
        iid = client.launch(h, ["chat"])
        client.signal(iid, "hello")
        client.signal(iid, "quit")
        assert [(e.event, e.message) for e in client.events(iid)] == [("message", "got:hello"), ("completed", "bye")]
        assert client.query("models") == ["fake-model"]
    assert host.free_pages() == 32


def test_run_remote_streams_messages_and_return_value(server, wasm_file) -> None:
    assert _run(server, wasm_file, ["echo", "one", "two"]) == (0, "one\ntwo\ndone\n", "")
    assert server.store.exists(__import__("hashlib").sha256(WASM).hexdigest())
    assert _run(server, wasm_file, ["echo"]) == (0, "done\n", "")  # second run: no upload needed


def test_run_remote_failures_exit_nonzero_with_reason(server, wasm_file, tmp_path) -> None:
    code, out, err = _run(server, wasm_file, ["crash"])
    assert (code, out) == (1, "") and "pie-run: inferlet exception: trap: boom" in err
    code, _, err = _run(server, wasm_file, ["oom"])
    assert code == 1 and "out_of_resources" in err
    bad = tmp_path / "bad.wasm"
    bad.write_bytes(b"garbage")
    code, _, err = _run(server, bad, [])
    assert code == 1 and "failed to compile" in err
    code, _, err = _run(server, tmp_path / "missing.wasm", [])
    assert code == 1 and "cannot read" in err


def test_run_remote_forwards_stdin_lines(server, wasm_file) -> None:
    code, out, _ = _run(server, wasm_file, ["chat"], stdin_lines=iter(["a\n", "b\n", "quit\n"]))
    assert (code, out) == (0, "got:a\ngot:b\nbye\n")


def test_run_remote_closes_input_at_end_of_stdin(server, wasm_file, host) -> None:
    # When the lines run out the client sends close_input: the inferlet's receive() returns none.
    code, out, _ = _run(server, wasm_file, ["chat"], stdin_lines=["x"])
    assert (code, out) == (0, "got:x\neof\n")
    assert not host.running


def test_close_input_needs_an_owned_instance(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            with pytest.raises(PieError, match="close_input: unknown or finished instance"):
                await client.close_input("no-such-instance")

    asyncio.run(main())


def test_run_remote_with_token_and_unreachable_server(tmp_path, wasm_file) -> None:
    with running_server(tmp_path / "d", auth_token="tok") as srv:
        assert _run(srv, wasm_file, ["echo"], token="tok")[0] == 0
        code, _, err = _run(srv, wasm_file, ["echo"], token="nope")
        assert code == 1 and "invalid token" in err
        code, _, err = _run(srv, wasm_file, ["echo"])
        assert code == 1 and "not authenticated" in err
        url = srv.url
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert run_remote(url, wasm_file, []) == 1
    assert "cannot connect" in err.getvalue()


def test_event_streams_end_aborted_and_requests_fail_when_the_server_goes(tmp_path) -> None:
    host = FakeHost()

    async def main(srv) -> None:
        client = await PieClient.connect(srv.url)
        iid = await client.launch(await client.upload_program(WASM), ["hold"], detached=True)
        await asyncio.to_thread(srv.stop_background)
        # The instance's terminal event comes before the close (docs/protocol.md, shutdown).
        assert [(e.event, e.message) async for e in client.events(iid)] == [("aborted", "server shutting down")]
        with pytest.raises(ConnectionLost):
            await client.ping()
        await client.close()

    with running_server(tmp_path, host=host) as srv:
        asyncio.run(main(srv))


def test_upload_error_raises_pie_error(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            with pytest.raises(ValueError, match="empty"):
                await client.upload_program(b"")
            with pytest.raises(PieError, match="unknown program"):
                await client.launch("f" * 64, [])

    asyncio.run(main())
