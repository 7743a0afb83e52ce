"""Every network input is bounded (issue 37), tried from a client's side against a live server on a
scripted host (the inbox test on a real `Host` with the stand-in backend). Where a bound is about
memory, the peak resident size of this process (the server runs in it) is measured against what
the attack would take unbounded."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fakes import FakeBackend
from helpers import wait_for, wasm_bytes
from server_support import WASM, FakeHost, PeakRss, running_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from host import Host, HostConfig
from host.client import PieClient, PieError
from host.client.protocol import CHUNK_SIZE, pack

MIB = 2**20


def _raw_http(port: int, data: bytes, timeout: float = 5.0) -> tuple[socket.socket, float]:
    """A socket that sent `data`; returns it and when it was sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(data)
    return sock, time.monotonic()


def _read_all(sock: socket.socket) -> bytes:
    """What the server sent until it closed (a reset after its answer keeps what came before)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def _chunked_until_answered(port: int | None, megabytes: int, pause_s: float = 0.0) -> bytes:
    """POST a chunked body of `megabytes` MiB (no Content-Length), stopping once the server answers;
    its answer (b"" if the connection was reset before it could be read)."""
    assert port is not None
    sock, _ = _raw_http(port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n", timeout=10)
    piece = b"%x\r\n" % MIB + b" " * MIB + b"\r\n"
    try:
        for _ in range(megabytes):
            if select.select([sock], [], [], pause_s)[0]:
                break
            sock.sendall(piece)
    except OSError:
        pass  # the server closed while we wrote; its answer may still be readable
    try:
        return _read_all(sock)
    finally:
        sock.close()


def test_a_client_that_does_not_read_is_dropped_not_buffered(tmp_path: Path) -> None:
    """The issue's attack: `query instances` answers of ~0.9 MB each, asked 300 times, never read
    (~270 MB unbounded). Past --max-queued-mb the connection is dropped, its instance ended."""
    host = FakeHost()
    with running_server(tmp_path, host=host, max_queued_bytes=4 * MIB) as srv:
        async def main() -> None:
            async with await PieClient.connect(srv.url) as bystander:
                h = await bystander.upload_program(WASM)
                await bystander.launch(h, ["hold", "p" * 900_000])
                with PeakRss() as rss:
                    with contextlib.suppress(ConnectionClosed):  # sends after the drop may fail
                        async with connect(srv.url, max_queue=1, max_size=None) as ws:
                            await ws.send(pack({"type": "launch_instance", "corr_id": 0, "program_hash": h,
                                                "arguments": ["hold"]}))
                            await ws.recv()
                            for i in range(1, 301):
                                await ws.send(pack({"type": "query", "corr_id": i, "subject": "instances"}))
                            await asyncio.to_thread(wait_for, lambda: len(srv.connections) == 1, 20, "the drop")
                assert rss.growth < 100 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"
                assert sum(1 for _, why in host.terminations if why == "client disconnected") == 1
                assert await bystander.ping() >= 0

        asyncio.run(main())


def test_a_detached_instance_buffers_a_bounded_tail_of_its_events(tmp_path: Path) -> None:
    """200 events of 1 MB from a detached instance nobody is attached to (~200 MB unbounded): the
    server keeps the last --max-queued-mb of them (and always the terminal event)."""
    host = FakeHost()
    with running_server(tmp_path, host=host, max_queued_bytes=4 * MIB) as srv:
        async def main() -> list[str]:
            async with await PieClient.connect(srv.url) as client:
                iid = await client.launch(await client.upload_program(WASM), ["later", "g", "200", "1000000"],
                                          detached=True)
            with PeakRss() as rss:
                host.open_gate("g")
                await asyncio.to_thread(wait_for, lambda: not host.running, 30, "the flood to end")
            assert rss.growth < 48 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"
            async with await PieClient.connect(srv.url) as again:
                await again.attach(iid)
                return [e.event async for e in again.events(iid)]

        events = asyncio.run(main())
    assert events[-1] == "completed" and 1 <= events.count("message") <= 4


def test_signal_past_the_inbox_is_refused_and_an_ended_instance_lets_its_inbox_go(tmp_path: Path) -> None:
    """100 signals of 1 MB to an instance that never reads (~100 MB unbounded): with a 2 MiB inbox
    the first two are taken, the rest refused with a clear error."""
    host = Host(HostConfig(data_dir=tmp_path / "host", max_inbox_bytes=2 * MIB, warm_auto=0),
                backend=FakeBackend())
    try:
        with running_server(tmp_path, host=host) as srv:
            async def main() -> None:
                async with await PieClient.connect(srv.url) as client:
                    iid = await client.launch(await client.upload_program(wasm_bytes("wasi_sleep")), ["a" * 500_000])
                    taken, refused = 0, []
                    with PeakRss() as rss:
                        for _ in range(100):
                            try:
                                await client.signal(iid, "m" * 1_000_000)
                                taken += 1
                            except PieError as e:
                                refused.append(str(e))
                    assert taken == 2 and len(refused) == 98
                    assert "inbox limit of 2097152 bytes" in refused[0] and "internal" not in refused[0]
                    assert rss.growth < 40 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"
                    await client.terminate(iid)
                    assert [e.event async for e in client.events(iid)] == ["aborted"]
                    ended = host._ended[iid]  # kept for wait(), without its unread messages or arguments
                    assert not ended.inbox and ended.inbox.bytes == 0 and ended.args == []

            asyncio.run(main())
    finally:
        host.shutdown()


def test_partial_uploads_are_bounded_per_server(tmp_path: Path) -> None:
    """Four connections each send 16 MiB of an unfinished 32 MiB upload (~64 MB unbounded); the
    server holds at most --max-uploads-mb (4 MiB) of them: past it a chunk is refused."""
    chunk = b"\0asm" + bytes(CHUNK_SIZE - 4)
    fake_hash = hashlib.sha256(b"never finished").hexdigest()
    total = 128  # chunks: 32 MiB

    def frame(i: int) -> bytes:
        return pack({"type": "upload_program", "corr_id": i, "program_hash": fake_hash, "chunk_index": i,
                     "total_chunks": total, "chunk_data": chunk})

    with running_server(tmp_path, max_upload_bytes_in_flight=4 * MIB, max_program_bytes=64 * MIB) as srv:
        async def one(results: list[str]) -> None:
            async with connect(srv.url) as ws:
                for i in range(64):
                    await ws.send(frame(i))
                    reply = await ws.recv()
                    if b"partial uploads" in reply:
                        results.append("refused")
                        return
                results.append("held")
                await asyncio.sleep(0.5)  # hold the partial upload while the others try

        async def main() -> list[str]:
            results: list[str] = []
            await asyncio.gather(*(one(results) for _ in range(4)))
            return results

        with PeakRss() as rss:
            results = asyncio.run(main())
        assert results.count("refused") >= 3, results
        assert rss.growth < 32 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"

        async def after() -> None:  # the budget came back when those connections closed
            async with await PieClient.connect(srv.url) as client:
                assert await client.upload_program(WASM + bytes(3 * CHUNK_SIZE)) is not None
        asyncio.run(after())


def test_http_body_past_the_limit_is_413_before_it_is_read(tmp_path: Path) -> None:
    with running_server(tmp_path, openai=True, max_body_bytes=1 * MIB) as srv:
        assert srv.port is not None
        # Content-Length says 1 GiB: answered at once, nothing of the body sent.
        sock, _ = _raw_http(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/json\r\nContent-Length: 1073741824\r\n\r\n")
        reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply
        # No length (chunked): read up to the limit, then 413.
        assert _chunked_until_answered(srv.port, 8, pause_s=0.2).startswith(b"HTTP/1.1 413")
        # Four such bodies of 64 MiB at once (the clients' writes then fail: the server closes
        # the connection, and the kernel resets it, with the rest unread).
        with PeakRss() as rss:
            with ThreadPoolExecutor(4) as pool:
                replies = list(pool.map(lambda _: _chunked_until_answered(srv.port, 64), range(4)))
        assert all(r.startswith(b"HTTP/1.1 413") or r == b"" for r in replies), [r[:40] for r in replies]
        assert rss.growth < 48 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"
        assert httpx.get(f"{srv.http_url}/health").status_code == 200


def test_connections_per_server_and_per_tenant(tmp_path: Path) -> None:
    with running_server(tmp_path, auth_token="adm", tenants=(("alice", "a"), ("bob", "b")), max_connections=4,
                        max_connections_per_tenant=2) as srv:
        async def main() -> None:
            a1 = await PieClient.connect(srv.url, token="a")
            a2 = await PieClient.connect(srv.url, token="a")
            with pytest.raises(PieError, match="maximum of 2 connections"):
                await PieClient.connect(srv.url, token="a")
            b1 = await PieClient.connect(srv.url, token="b")  # another tenant is not affected
            await asyncio.to_thread(wait_for, lambda: len(srv.connections) == 3, 5, "the refused one to go")
            b2 = await PieClient.connect(srv.url, token="b")
            with pytest.raises(InvalidStatus) as full:  # the server's 4 are open
                async with connect(srv.url):
                    pass
            assert full.value.response.status_code == 503
            assert (await asyncio.to_thread(httpx.get, f"{srv.http_url}/health")).status_code == 503
            await a1.close()
            await asyncio.to_thread(wait_for, lambda: len(srv.connections) == 3, 5, "a1 to go")
            async with await PieClient.connect(srv.url, token="a") as a3:
                assert await a3.ping() >= 0
            for c in (a2, b1, b2):
                await c.close()

        asyncio.run(main())


def test_unauthenticated_connection_is_closed_after_the_auth_timeout(tmp_path: Path) -> None:
    with running_server(tmp_path, auth_token="adm", auth_timeout_s=0.3) as srv:
        async def main() -> float:
            async with connect(srv.url) as ws:
                start = time.monotonic()
                with pytest.raises(ConnectionClosed) as info:
                    await asyncio.wait_for(ws.recv(), 5)
                assert info.value.rcvd is not None and info.value.rcvd.code == 1008
                assert "not authenticated within" in info.value.rcvd.reason
                return time.monotonic() - start

        assert asyncio.run(main()) < 2.0


def test_slow_headers_and_a_stalled_body_time_out(tmp_path: Path) -> None:
    with running_server(tmp_path, openai=True, read_timeout_s=0.5) as srv:
        assert srv.port is not None
        sock, sent = _raw_http(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        assert _read_all(sock) == b"" and time.monotonic() - sent < 2.5  # closed, nothing answered
        sock, sent = _raw_http(srv.port, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                               b"Content-Length: 100\r\n\r\n{\"model\": ")
        reply = _read_all(sock)
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert time.monotonic() - sent < 2.5
        assert httpx.get(f"{srv.http_url}/health").status_code == 200


def _post_and_never_read(port: int | None, content: str) -> socket.socket:
    assert port is not None
    body = json.dumps({"model": "fake-model", "stream": True,
                       "messages": [{"role": "user", "content": content}]}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


@pytest.mark.parametrize("flood, queued_mb", [(2_000, 16), (20_000, 4)])
def test_an_sse_client_that_stops_reading_is_dropped_and_its_instance_ended(tmp_path: Path, flood: int,
                                                                            queued_mb: int) -> None:
    """2,000 deltas of 4 KiB (8 MB): the server's write to the client stalls past --write-timeout-s.
    20,000 (80 MB): faster than any socket takes them; past --max-queued-mb the instance is ended."""
    host = FakeHost()
    with running_server(tmp_path, host=host, openai=True, write_timeout_s=0.5,
                        max_queued_bytes=queued_mb * MIB) as srv:
        with PeakRss() as rss:
            sock = _post_and_never_read(srv.port, f"flood {flood} hold")
            wait_for(lambda: bool(host.terminations), 20, "the instance to be ended")
            wait_for(lambda: not host.running, 5, "the instance to end")
        assert host.terminations[0][1] == ("client went away" if flood == 2_000 else "client not reading")
        assert rss.growth < 40 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"
        sock.close()
        assert httpx.get(f"{srv.http_url}/health").status_code == 200


def test_messages_emitted_while_the_event_loop_is_busy_count_against_max_queued(tmp_path: Path) -> None:
    """The bound holds when the instance outruns the server's event loop: 80 MB of deltas emitted
    while the loop is blocked for 1.5 s must not pile up in the loop's queue of callbacks."""
    host = FakeHost()
    with running_server(tmp_path, host=host, openai=True, write_timeout_s=5, max_queued_bytes=4 * MIB) as srv:
        assert srv._loop is not None
        with PeakRss() as rss:
            sock = _post_and_never_read(srv.port, "gated g flood 20000 hold")
            wait_for(lambda: bool(host.running), 5, "the instance to start")
            busy = threading.Event()

            def block() -> None:
                busy.set()
                time.sleep(1.5)

            srv._loop.call_soon_threadsafe(block)
            assert busy.wait(5)
            host.open_gate("g")
            wait_for(lambda: bool(host.terminations), 20, "the instance to be ended")
            wait_for(lambda: not host.running, 5, "the instance to end")
        assert host.terminations[0][1] == "client not reading"
        assert rss.growth < 40 * MIB, f"server grew by {rss.growth / MIB:.0f} MiB"
        sock.close()
        assert httpx.get(f"{srv.http_url}/health").status_code == 200


def test_store_quota_per_tenant_evicts_the_least_recently_launched(tmp_path: Path) -> None:
    progs = [WASM + bytes([i]) * 40 for i in range(3)]
    with running_server(tmp_path, max_store_bytes_per_tenant=2 * len(progs[0])) as srv:
        async def main() -> None:
            async with await PieClient.connect(srv.url) as client:
                h0, h1 = await client.upload_program(progs[0]), await client.upload_program(progs[1])
                iid = await client.launch(h0, ["echo"])  # h0 is launched: h1 is now the least recent
                assert [e.event async for e in client.events(iid)] == ["completed"]
                h2 = await client.upload_program(progs[2])
                assert await client.program_exists(h0) and await client.program_exists(h2)
                assert not await client.program_exists(h1)
                with pytest.raises(PieError, match="more than the store quota"):
                    await client.upload_program(WASM + bytes(3 * len(progs[0])))

        asyncio.run(main())


def test_finished_detached_instances_keep_a_bounded_total_of_events() -> None:
    """Nobody attaches to 40 finished detached instances of ~900 bytes of events each: with a
    1,000-byte buffer bound, at most 16 x 1,000 bytes are kept, the oldest instances forgotten."""
    from host.events import InstanceEvent
    from host.server.instances import FINISHED_DETACHED_BUFFERS, InstanceRecord, InstanceTable

    table = InstanceTable(lambda iid, why: None, event_buffer_limit=100, event_buffer_bytes=1000)
    for i in range(40):
        record = InstanceRecord(program="p", detached=True, owner=None, id=f"i{i}")
        table.add(record)
        table.on_event(record, InstanceEvent(record.id, "message", "x" * 850))
        table.on_event(record, InstanceEvent(record.id, "completed", ""))
    kept = sorted(int(iid[1:]) for iid in table.records)
    assert sum(r.buffered_bytes for r in table.records.values()) <= FINISHED_DETACHED_BUFFERS * 1000
    assert kept == list(range(40 - len(kept), 40)) and 10 <= len(kept) <= 17  # the newest


def test_one_tenant_holds_at_most_its_share_of_the_partial_upload_budget() -> None:
    from host.server.programs import Upload, UploadBudget, UploadError

    budget = UploadBudget(8 * MIB, min_share=3 * MIB)  # share: half of 8 MiB
    assert budget.tenant_share == 4 * MIB
    assert UploadBudget(8 * MIB, min_share=6 * MIB).tenant_share == 6 * MIB  # one largest program fits
    assert UploadBudget(4 * MIB, min_share=64 * MIB).tenant_share == 4 * MIB  # never past the whole
    a1 = Upload("0" * 64, 16, 4 * MIB, budget, tenant="a")
    for i in range(12):  # 3 MiB
        a1.add("0" * 64, i, 16, bytes(CHUNK_SIZE))
    a2 = Upload("1" * 64, 16, 4 * MIB, budget, tenant="a")
    for i in range(4):  # 1 MiB more: a's whole share
        a2.add("1" * 64, i, 16, bytes(CHUNK_SIZE))
    with pytest.raises(UploadError, match=r"tenant 'a' holds 4194304 bytes of partial uploads, its share of the "
                                          r"server's is 4194304"):
        a2.add("1" * 64, 4, 16, bytes(CHUNK_SIZE))
    b = Upload("2" * 64, 16, 4 * MIB, budget, tenant="b")
    for i in range(16):  # b still gets its own share
        b.add("2" * 64, i, 16, bytes(CHUNK_SIZE))
    a2.discard()
    assert budget.by_tenant == {"a": 3 * MIB, "b": 4 * MIB} and budget.used == 7 * MIB
    a1.discard()
    b.discard()
    assert budget.by_tenant == {} and budget.used == 0


def test_a_tenant_holding_its_share_of_partial_uploads_leaves_room_for_another(tmp_path: Path) -> None:
    """Tenant A's four connections each hold an unfinished 3 MiB upload: past A's share (half of
    --max-uploads-mb 8 MiB) its chunks are refused, naming its share; tenant B still uploads."""
    chunk = b"\0asm" + bytes(CHUNK_SIZE - 4)
    fake_hash = hashlib.sha256(b"never finished").hexdigest()
    alice, bob = "alice-token-0123456789", "bob-token-0123456789"

    def frame(i: int) -> bytes:
        return pack({"type": "upload_program", "corr_id": i + 1, "program_hash": fake_hash, "chunk_index": i,
                     "total_chunks": 16, "chunk_data": chunk})

    with running_server(tmp_path, max_upload_bytes_in_flight=8 * MIB, max_program_bytes=4 * MIB,
                        tenants=(("alice", alice), ("bob", bob))) as srv:
        held = asyncio.Event()
        refusals: list[str] = []

        async def hog() -> None:
            async with connect(srv.url) as ws:
                await ws.send(pack({"type": "authenticate", "corr_id": 0, "token": alice}))
                await ws.recv()
                for i in range(12):
                    await ws.send(frame(i))
                    reply = await ws.recv()
                    if b"share" in reply:
                        refusals.append(bytes(reply).decode("utf-8", "replace") if isinstance(reply, bytes) else reply)
                        break
                await held.wait()  # hold the partial upload while bob uploads

        async def main() -> None:
            hogs = [asyncio.create_task(hog()) for _ in range(4)]
            await wait_until(lambda: len(refusals) >= 2)
            async with await PieClient.connect(srv.url, token=bob) as client:
                assert await client.upload_program(WASM + bytes(3 * CHUNK_SIZE)) is not None
            held.set()
            await asyncio.gather(*hogs)

        async def wait_until(cond) -> None:  # noqa: ANN001
            for _ in range(500):
                if cond():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError(f"alice's uploads were never refused: {refusals}")

        asyncio.run(main())
        assert all("tenant 'alice'" in r and "its share of the server's is 4194304" in r for r in refusals), refusals


def test_responses_on_a_kept_alive_connection_are_not_held_for_the_clients_ack(tmp_path: Path) -> None:
    """uvicorn writes a response's headers and then its body. With Nagle's algorithm on (asyncio leaves
    it on for the sockets `socket.create_server` accepts), the body waited for the client's delayed
    ACK of the headers: every response after a connection's first took >= 40 ms (Linux's minimum
    delayed-ACK time), 44 ms for GET /v1/models. The server turns Nagle off; the fastest of five
    such responses is then well under that."""
    with running_server(tmp_path, openai=True) as server, httpx.Client(base_url=server.http_url) as client:
        assert client.get("/v1/models").status_code == 200  # the connection's first (quick-ACK mode)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            assert client.get("/v1/models").status_code == 200
            times.append(time.perf_counter() - t)
        assert min(times) < 0.03, times
