"""End to end through the server with the real host, the real default model and text_completion."""

from __future__ import annotations

import asyncio
import io
import time
from contextlib import redirect_stderr, redirect_stdout

import pytest
from helpers import FIXTURES, wait_for, wasm_bytes
from server_support import running_server

from host.cli.build import resolve_inferlet
from host.client import PieClient, PieError, run_remote

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def host(real_host):
    return real_host


@pytest.fixture(scope="module")
def server(host, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("server"), host=host) as srv:
        yield srv


def test_pie_run_server_answers_the_question(server) -> None:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = run_remote(server.url, resolve_inferlet("text_completion", quiet=True),
                          ["--prompt", QUESTION, "--max-tokens", "16"], token=None)
    assert code == 0, err.getvalue()
    assert "Paris" in out.getvalue()


def test_streamed_messages_then_completed(server, host) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            h = await client.ensure_program(wasm_bytes("text_completion"))
            iid = await client.launch(h, ["--prompt", QUESTION, "--max-tokens", "16", "--stream"])
            events = [e async for e in client.events(iid)]
        assert [e.event for e in events[:-1]] == ["message"] * (len(events) - 1) and len(events) > 2
        assert events[-1].event == "completed"
        assert "".join(e.message for e in events[:-1]) == events[-1].message
        assert "Paris" in events[-1].message

    asyncio.run(main())
    wait_for(lambda: host.free_pages() == host.total_pages)


def test_disconnect_mid_generation_aborts_and_frees_pages(server, host) -> None:
    start = host.free_pages()

    async def main() -> str:
        client = await PieClient.connect(server.url)
        h = await client.ensure_program(wasm_bytes("text_completion"))
        iid = await client.launch(h, ["--prompt", "Write a very long story about a dragon, in ten chapters.",
                                      "--max-tokens", "4000", "--stream"])
        try:
            async for event in client.events(iid):
                assert event.event == "message", event  # generating: pages are held now
                break
            assert host.free_pages() < start
        finally:
            await client.close()
        return iid

    iid = asyncio.run(main())
    wait_for(lambda: host.free_pages() == start, timeout=30)
    assert all(i["id"] != iid for i in host.instances())


def test_bad_component_rejected_with_wasmtime_reason(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            with pytest.raises(PieError, match="failed to compile"):
                await client.upload_program(b"\0asm\x01\x00\x00\x00\xff broken")

    asyncio.run(main())


def _state(host, iid: str) -> str | None:
    return next((i["state"] for i in host.instances() if i["id"] == iid), None)


def test_terminate_spinning_guest(server, host) -> None:
    import wasmtime

    spin = bytes(wasmtime.wat2wasm((FIXTURES / "loop.wat").read_text()))

    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            iid = await client.launch(await client.ensure_program(spin), [])
            await asyncio.to_thread(wait_for, lambda: _state(host, iid) == "running", what="the guest running")
            await client.terminate(iid)
            events = [(e.event, e.message) async for e in client.events(iid)]
        assert events == [("aborted", "terminated by request")]

    asyncio.run(main())


def test_64_concurrent_clients_complete_without_leaking_pages(server, host) -> None:
    wasm = wasm_bytes("text_completion")
    start = host.free_pages()

    async def one(n: int) -> str:
        async with await PieClient.connect(server.url) as client:
            h = await client.ensure_program(wasm)
            iid = await client.launch(h, ["--prompt", f"Count to {n}.", "--max-tokens", "8"])
            events = [e async for e in client.events(iid)]
        assert events[-1].event == "completed", events[-1]
        return events[-1].message

    async def main() -> list[str]:
        return await asyncio.gather(*(one(n) for n in range(64)))

    t0 = time.perf_counter()
    answers = asyncio.run(main())
    assert len(answers) == 64 and all(answers)
    assert time.perf_counter() - t0 < 300
    wait_for(lambda: host.free_pages() == start, timeout=30)
    assert host.instances() == []
