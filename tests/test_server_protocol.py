"""Protocol v1 against a scripted host: bad input is answered and never fatal; auth; uploads."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import msgpack
import pytest
from helpers import wait_for
from server_support import WASM, FakeHost, exchange, running_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from host.client import PieClient, PieError
from host.client.protocol import CHUNK_SIZE, pack
from host.server import ServerConfig

WASM_HASH = hashlib.sha256(WASM).hexdigest()


async def closed_with(url: str, frame: bytes | str) -> tuple[int, str]:
    """Send `frame`; return the close code and reason the server answered with."""
    async with connect(url) as ws:
        await ws.send(frame)
        with pytest.raises(ConnectionClosed) as info:
            await asyncio.wait_for(ws.recv(), 5)
    rcvd = info.value.rcvd
    assert rcvd is not None
    return rcvd.code, rcvd.reason


async def still_serving(url: str) -> None:
    async with await PieClient.connect(url) as client:
        assert await client.ping() >= 0
        assert await client.query("models") == ["fake-model"]


@pytest.fixture
def server(tmp_path: Path):
    with running_server(tmp_path) as srv:
        yield srv


@pytest.mark.parametrize("frame, code, words", [
    ("a text frame", 1003, "text frames"),
    (b"\xc1\x00", 1007, "not valid msgpack"),
    (pack([1, 2, 3]), 1007, "must be a msgpack map"),
    (pack({"corr_id": "seven", "type": "ping"}), 1008, "corr_id"),
    (pack({"type": "ping"}), 1008, "missing field 'corr_id'"),
    (pack({"no": "type"}), 1008, "unknown message type"),
])
def test_unreadable_frames_close_with_reason(server, frame, code, words) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as bystander:  # another connection, open throughout
            got_code, reason = await closed_with(server.url, frame)
            assert got_code == code
            assert words in reason
            assert await bystander.ping() >= 0
        await still_serving(server.url)

    asyncio.run(main())


@pytest.mark.parametrize("msg, words", [
    ({"corr_id": 1}, "unknown message type None"),
    ({"type": "launch_rocket", "corr_id": 1}, "unknown message type 'launch_rocket'"),
    ({"type": "query", "corr_id": 1}, "missing field 'subject'"),
    ({"type": "query", "corr_id": 1, "subject": "weather"}, "field 'subject' must be one of"),
    ({"type": "query", "corr_id": 1, "subject": "program_exists", "record": 5}, "record must be a program hash"),
    ({"type": "launch_instance", "corr_id": 1, "program_hash": WASM_HASH, "arguments": "echo"},
     "field 'arguments' must be a list of strings"),
    ({"type": "launch_instance", "corr_id": 1, "program_hash": WASM_HASH, "arguments": [1]},
     "field 'arguments' must be a list of strings"),
    ({"type": "launch_instance", "corr_id": 1, "program_hash": "abc", "arguments": []}, "64 lowercase hex"),
    ({"type": "launch_instance", "corr_id": 1, "program_hash": WASM_HASH, "arguments": [], "detached": 1},
     "field 'detached' must be a boolean"),
    ({"type": "launch_instance", "corr_id": 1, "program_hash": "0" * 64, "arguments": []}, "unknown program"),
    ({"type": "upload_program", "corr_id": 1, "program_hash": WASM_HASH, "chunk_index": 0, "total_chunks": 1,
      "chunk_data": "text, not bytes"}, "field 'chunk_data' must be binary"),
    ({"type": "upload_program", "corr_id": 1, "program_hash": WASM_HASH, "chunk_index": -1, "total_chunks": 1,
      "chunk_data": b"x"}, "field 'chunk_index' must be a non-negative integer"),
    ({"type": "terminate_instance", "corr_id": 1, "instance_id": "nope"}, "unknown or finished instance 'nope'"),
    ({"type": "signal_instance", "corr_id": 1, "instance_id": "nope", "message": "hi"}, "unknown or finished"),
    ({"type": "attach_instance", "corr_id": 1, "instance_id": "nope"}, "unknown instance 'nope'"),
    ({"type": "authenticate", "corr_id": 1, "token": None}, "field 'token' must be a string"),
])
def test_bad_requests_get_error_responses(server, msg, words) -> None:
    async def main() -> None:
        reply = await exchange(server.url, pack(msg))
        assert reply["type"] == "response" and reply["corr_id"] == 1 and reply["successful"] is False
        assert words in reply["result"]
        await still_serving(server.url)

    asyncio.run(main())


def test_signal_without_corr_id_reports_error_with_null_corr_id(server) -> None:
    reply = asyncio.run(exchange(server.url, pack({"type": "signal_instance", "instance_id": "x", "message": "m"})))
    assert reply == {"type": "response", "corr_id": None, "successful": False,
                     "result": "signal_instance: unknown or finished instance 'x'"}


def test_frame_over_size_limit_closes_with_reason(tmp_path) -> None:
    async def main(url: str) -> None:
        async with await PieClient.connect(url) as bystander:
            code, reason = await closed_with(url, pack({"type": "ping", "corr_id": 1, "pad": b"x" * 70_000}))
            assert code == 1009 and "exceeds limit of 65536 bytes" in reason
            assert await bystander.ping() >= 0

    with running_server(tmp_path, max_frame_bytes=64 * 1024) as srv:
        asyncio.run(main(srv.url))


def test_auth_token_required(tmp_path) -> None:
    async def main(url: str) -> None:
        async with await PieClient.connect(url) as client:
            assert await client.ping() >= 0  # allowed before authenticating
            with pytest.raises(PieError, match="not authenticated"):
                await client.query("models")
            with pytest.raises(PieError, match="not authenticated"):
                await client.upload_program(WASM)
            with pytest.raises(PieError, match="invalid token"):
                await client.authenticate("wrong")
            await client.authenticate("s3cret")
            assert await client.query("models") == ["fake-model"]
        async with await PieClient.connect(url, token="s3cret") as client:
            assert await client.upload_program(WASM) == WASM_HASH

    with running_server(tmp_path, auth_token="s3cret") as srv:
        asyncio.run(main(srv.url))


def test_each_token_is_a_tenant_and_instances_act_for_theirs(tmp_path) -> None:
    host = FakeHost()

    async def launch_as(url: str, token: str | None) -> str:
        async with await PieClient.connect(url, token=token) as client:
            program = await client.ensure_program(WASM)
            return await client.launch(program, ["echo", "x"])

    with running_server(tmp_path, host=host, auth_token="s3cret", tenants=(("alice", "a-tok"),)) as srv:
        a = asyncio.run(launch_as(srv.url, "a-tok"))
        d = asyncio.run(launch_as(srv.url, "s3cret"))
        with pytest.raises(PieError, match="not authenticated"):
            asyncio.run(launch_as(srv.url, None))
    assert (host.tenants[a], host.tenants[d]) == ("alice", "default")
    with running_server(tmp_path, host=host) as srv:  # no token: one tenant, "local"
        assert host.tenants[asyncio.run(launch_as(srv.url, None))] == "local"
    with pytest.raises(ValueError, match="its own non-empty token"):
        ServerConfig(auth_token="same", tenants=(("bob", "same"),))


def test_repeated_bad_tokens_close_the_connection(tmp_path) -> None:
    async def main(url: str) -> None:
        async with connect(url) as ws:
            for i in range(3):
                await ws.send(pack({"type": "authenticate", "corr_id": i, "token": "guess"}))
                reply = msgpack.unpackb(await ws.recv())
                assert reply["successful"] is False
            with pytest.raises(ConnectionClosed) as info:
                await asyncio.wait_for(ws.recv(), 5)
            assert "failed authentication" in info.value.rcvd.reason

    with running_server(tmp_path, auth_token="s3cret") as srv:
        asyncio.run(main(srv.url))


def _chunk(i: int, total: int, data: bytes, program_hash: str = WASM_HASH, corr_id: int = 1) -> bytes:
    return pack({"type": "upload_program", "corr_id": corr_id, "program_hash": program_hash,
                 "chunk_index": i, "total_chunks": total, "chunk_data": data})


async def _replies(url: str, frames: list[bytes]) -> list[dict]:
    async with connect(url) as ws:
        for f in frames:
            await ws.send(f)
        return [msgpack.unpackb(await asyncio.wait_for(ws.recv(), 5)) for _ in frames]


def test_upload_rejects_out_of_order_oversized_and_wrong_hash(server) -> None:
    half = len(WASM) // 2
    out_of_order = asyncio.run(_replies(server.url, [_chunk(0, 2, WASM[:half]), _chunk(2, 2, WASM[half:])]))
    assert out_of_order[0]["successful"] and out_of_order[0]["result"] == 0
    assert not out_of_order[1]["successful"]
    assert "out-of-order" in out_of_order[1]["result"] or "chunk_index 2" in out_of_order[1]["result"]

    no_start = asyncio.run(_replies(server.url, [_chunk(1, 2, WASM[half:])]))
    assert "no upload in progress" in no_start[0]["result"]

    oversized = asyncio.run(_replies(server.url, [_chunk(0, 1, b"\0asm" + b"x" * CHUNK_SIZE)]))
    assert f"the limit is {CHUNK_SIZE}" in oversized[0]["result"]

    wrong = asyncio.run(_replies(server.url, [_chunk(0, 1, WASM + b"tampered")]))
    assert "hash mismatch" in wrong[0]["result"]

    too_many = asyncio.run(_replies(server.url, [_chunk(0, 10**6, WASM)]))
    assert "exceeds the limit" in too_many[0]["result"]
    assert not server.store.exists(WASM_HASH)
    asyncio.run(still_serving(server.url))


def test_program_rejected_at_upload_with_compiler_reason(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            with pytest.raises(PieError, match="failed to compile: input bytes aren't valid"):
                await client.upload_program(b"not a component")
            assert not await client.program_exists(hashlib.sha256(b"not a component").hexdigest())

    asyncio.run(main())


def test_store_survives_restart_and_reupload_is_noop(tmp_path) -> None:
    big = WASM + bytes(range(256)) * 3000  # 3 chunks

    async def upload(url: str) -> str:
        async with await PieClient.connect(url) as client:
            assert not await client.program_exists(hashlib.sha256(big).hexdigest())
            h = await client.upload_program(big)
            assert await client.program_exists(h)
            assert await client.upload_program(big) == h  # again: accepted, nothing changes
            return h

    host = FakeHost()
    with running_server(tmp_path, host=host) as srv:
        h = asyncio.run(upload(srv.url))
        assert host.compile_calls == 1
        assert srv.store.path(h).read_bytes() == big

    async def launch_after_restart(url: str) -> list[str]:
        async with await PieClient.connect(url) as client:
            assert await client.program_exists(h)
            iid = await client.launch(h, ["echo", "hi"])
            return [e.event async for e in client.events(iid)]

    fresh = FakeHost()  # a new process: nothing compiled in memory
    with running_server(tmp_path, host=fresh) as srv:
        assert asyncio.run(launch_after_restart(srv.url)) == ["message", "completed"]
        assert fresh.compile_calls == 1


def test_queries(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            h = await client.upload_program(WASM)
            iid = await client.launch(h, ["hold"], detached=True)
            listed = await client.query("instances")
            assert [(i["id"], i["arguments"], i["detached"], i["attached"]) for i in listed] == \
                [(iid, ["hold"], True, True)]
            stats = await client.query("stats")
            assert stats["host"]["instances"] == 1
            assert stats["server"]["connections"] == 1 and stats["server"]["programs"] == 1
            await client.terminate(iid)
            assert [e.event async for e in client.events(iid)] == ["aborted"]

    asyncio.run(main())


def test_internal_error_is_answered(server, monkeypatch) -> None:
    def broken() -> list[str]:
        raise RuntimeError("backend exploded")

    monkeypatch.setattr(server.host, "model_names", broken)
    reply = asyncio.run(exchange(server.url, pack({"type": "query", "corr_id": 9, "subject": "models"})))
    assert reply["successful"] is False and "backend exploded" in reply["result"]
    wait_for(lambda: server.host.free_pages() == server.host.total_pages)
