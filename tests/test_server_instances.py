"""Instances over the server: events, signals, ownership, disconnect, detached + attach."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from helpers import wait_for
from server_support import WASM, FakeHost, running_server
from websockets.asyncio.client import connect

from host.client import PieClient, PieError
from host.client.protocol import pack


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(total_pages=64)


@pytest.fixture
def server(tmp_path: Path, host: FakeHost):
    with running_server(tmp_path, host=host) as srv:
        yield srv


async def _events(client: PieClient, iid: str) -> list[tuple[str, str]]:
    return [(e.event, e.message) async for e in client.events(iid)]


def test_events_in_order_for_each_outcome(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            h = await client.upload_program(WASM)
            echo = await client.launch(h, ["echo", "a", "b", "c"])
            crash = await client.launch(h, ["crash"])
            oom = await client.launch(h, ["oom"])
            assert await _events(client, echo) == [("message", "a"), ("message", "b"), ("message", "c"),
                                                   ("completed", "done")]
            assert await _events(client, crash) == [("exception", "trap: boom")]
            assert await _events(client, oom) == [("out_of_resources", "out of KV pages")]

    asyncio.run(main())


def test_signals_reach_the_instance_and_terminate_aborts(server, host) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            h = await client.upload_program(WASM)
            chat = await client.launch(h, ["chat"])
            await client.signal(chat, "one")
            await client.signal(chat, "two", wait=False)
            await client.signal(chat, "quit")
            assert await _events(client, chat) == [("message", "got:one"), ("message", "got:two"),
                                                   ("completed", "bye")]
            hold = await client.launch(h, ["hold"])
            await client.terminate(hold)
            assert await _events(client, hold) == [("aborted", "terminated by request")]
            with pytest.raises(PieError, match="unknown or finished instance"):
                await client.signal(hold, "too late")

    asyncio.run(main())
    assert host.free_pages() == 64


def test_disconnect_terminates_owned_instances_and_frees_pages(server, host) -> None:
    async def main() -> list[str]:
        client = await PieClient.connect(server.url)
        h = await client.upload_program(WASM)
        iids = [await client.launch(h, ["hold"]) for _ in range(5)]
        assert host.free_pages() == 64 - 2 * 5
        await client.close()
        return iids

    iids = asyncio.run(main())
    wait_for(lambda: host.free_pages() == 64)
    assert sorted(host.terminations) == sorted((iid, "client disconnected") for iid in iids)
    wait_for(lambda: len(server.instances) == 0)


def test_instances_of_other_connections_are_off_limits(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as owner, await PieClient.connect(server.url) as other:
            h = await owner.upload_program(WASM)
            iid = await owner.launch(h, ["chat"])
            for call in (other.signal(iid, "x"), other.terminate(iid)):
                with pytest.raises(PieError, match="not attached to this connection"):
                    await call
            with pytest.raises(PieError, match="attached to another connection"):
                await other.attach(iid)
            await owner.signal(iid, "quit")
            assert await _events(owner, iid) == [("completed", "bye")]

    asyncio.run(main())


def test_detached_instance_survives_and_buffers_until_attached(server, host) -> None:
    async def launch_and_leave() -> tuple[str, str]:
        async with await PieClient.connect(server.url) as client:
            h = await client.upload_program(WASM)
            chat = await client.launch(h, ["chat"], detached=True)
            done = await client.launch(h, ["gated", "go", "x", "y"], detached=True)
            return chat, done

    chat, done = asyncio.run(launch_and_leave())
    record = server.instances.get(done)
    assert record is not None
    wait_for(lambda: record.owner is None)  # the server has seen the disconnect
    host.open_gate("go")
    wait_for(lambda: len(host.running) == 1)  # "done" finished unattended, chat still running
    assert host.terminations == []

    async def come_back() -> None:
        async with await PieClient.connect(server.url) as client:
            listed = {i["id"]: i for i in await client.query("instances")}
            assert listed[chat]["detached"] and not listed[chat]["attached"]
            with pytest.raises(PieError, match="attach_instance first"):
                await client.signal(chat, "not yet")
            await client.attach(done)
            assert await _events(client, done) == [("message", "x"), ("message", "y"), ("completed", "done")]
            await client.attach(chat)
            await client.signal(chat, "after")
            await client.signal(chat, "quit")
            assert await _events(client, chat) == [("message", "got:after"), ("completed", "bye")]
            with pytest.raises(PieError, match="unknown instance"):
                await client.attach(done)  # delivered once, then forgotten

    asyncio.run(come_back())
    assert host.free_pages() == 64


def test_attach_is_refused_for_non_detached(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url) as client:
            h = await client.upload_program(WASM)
            iid = await client.launch(h, ["hold"])
            await client.attach(iid)  # own instance: a no-op
            await client.terminate(iid)
            assert (await _events(client, iid))[-1][0] == "aborted"

    asyncio.run(main())


def test_stop_terminates_detached_instances(tmp_path) -> None:
    host = FakeHost(total_pages=16)
    with running_server(tmp_path, host=host) as srv:
        async def main() -> None:
            async with await PieClient.connect(srv.url) as client:
                await client.launch(await client.upload_program(WASM), ["hold"], detached=True)

        asyncio.run(main())
    wait_for(lambda: host.free_pages() == 16)
    assert [reason for _, reason in host.terminations] == ["server shutting down"]


def test_many_clients_many_instances(server, host) -> None:
    async def one(n: int) -> list[tuple[str, str]]:
        async with await PieClient.connect(server.url) as client:
            h = await client.ensure_program(WASM)
            iid = await client.launch(h, ["echo", str(n)])
            return await _events(client, iid)

    async def main() -> None:
        results = await asyncio.gather(*(one(n) for n in range(64)))
        assert results == [[("message", str(n)), ("completed", "done")] for n in range(64)]

    asyncio.run(main())
    assert host.free_pages() == 64


def test_soak_mixed_clients_leave_nothing_behind(server, host) -> None:
    """Waves of clients that finish, vanish mid-run, send garbage or detach: no page, record or
    connection is left over, and the server still answers."""
    async def well_behaved(n: int) -> None:
        async with await PieClient.connect(server.url) as client:
            iid = await client.launch(await client.ensure_program(WASM), ["echo", str(n)])
            assert (await _events(client, iid))[-1] == ("completed", "done")

    async def vanishes() -> None:
        client = await PieClient.connect(server.url)
        h = await client.ensure_program(WASM)
        await client.launch(h, ["hold"])
        await client.launch(h, ["chat"])
        await client.close()

    async def garbage() -> None:
        async with connect(server.url) as ws:
            await ws.send(b"\xc1garbage")
            await ws.wait_closed()

    async def detaches_then_attaches() -> None:
        async with await PieClient.connect(server.url) as client:
            iid = await client.launch(await client.ensure_program(WASM), ["chat"], detached=True)
        async with await PieClient.connect(server.url) as client:
            await client.attach(iid)
            await client.signal(iid, "quit")
            assert (await _events(client, iid))[-1] == ("completed", "bye")

    async def main() -> None:
        for _wave in range(3):
            await asyncio.gather(*(well_behaved(n) for n in range(20)), *(vanishes() for _ in range(10)),
                                 *(garbage() for _ in range(5)), *(detaches_then_attaches() for _ in range(5)))

    asyncio.run(main())
    wait_for(lambda: host.free_pages() == 64 and not host.running)
    wait_for(lambda: len(server.instances) == 0 and not server.connections)


def test_client_that_stops_reading_is_dropped(tmp_path) -> None:
    host = FakeHost()

    async def main(srv) -> None:
        async with await PieClient.connect(srv.url) as bystander:
            h = await bystander.upload_program(WASM)
            async with connect(srv.url, max_queue=1, close_timeout=0.5) as ws:  # reads nothing
                await ws.send(pack({"type": "launch_instance", "corr_id": 1, "program_hash": h,
                                    "arguments": ["flood", "4000", "4000"]}))
                await asyncio.to_thread(wait_for, lambda: len(srv.connections) == 1, 30)
            assert await bystander.ping() >= 0

    with running_server(tmp_path, host=host, max_queued_frames=100) as srv:
        asyncio.run(main(srv))
