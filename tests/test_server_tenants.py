"""Tenant isolation over protocol v1 (issue 37): a tenant sees and acts on its own instances and
programs only; the admin identity (--auth-token) sees all. From a client's side, on a scripted host."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import pytest
from helpers import wait_for
from server_support import WASM, FakeHost, running_server

from host.client import PieClient, PieError
from host.server.programs import ProgramStore

ADMIN, ALICE, BOB = "admin-tok", "tok-alice", "tok-bob"
OTHER_WASM = WASM + b" another program"


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(total_pages=64)


@pytest.fixture
def server(tmp_path: Path, host: FakeHost):
    with running_server(tmp_path, host=host, auth_token=ADMIN, tenants=(("alice", ALICE), ("bob", BOB))) as srv:
        yield srv


def test_query_instances_shows_a_tenant_its_own_only(server) -> None:
    async def main() -> None:
        async with (await PieClient.connect(server.url, token=ALICE) as alice,
                    await PieClient.connect(server.url, token=BOB) as bob,
                    await PieClient.connect(server.url, token=ADMIN) as admin):
            secret = await alice.launch(await alice.upload_program(WASM), ["hold", "My password is ALICE-SECRET"],
                                        detached=True)
            mine = await bob.launch(await bob.upload_program(WASM), ["hold", "bob's"])
            assert [i["id"] for i in await bob.query("instances")] == [mine]
            assert "ALICE-SECRET" not in repr(await bob.query("instances"))
            assert [(i["id"], i["tenant"]) for i in await alice.query("instances")] == [(secret, "alice")]
            assert sorted((i["tenant"], i["id"]) for i in await admin.query("instances")) == \
                sorted([("alice", secret), ("bob", mine)])
            bob_stats = (await bob.query("stats"))["server"]
            assert bob_stats == {"connections": 1, "instances": 1, "programs": 1}  # bob's own numbers only
            assert (await admin.query("stats"))["server"]["connections"] == 3
            await alice.terminate(secret)

    asyncio.run(main())


def test_another_tenants_instance_is_unknown_to_every_request(server, host) -> None:
    async def main() -> None:
        alice = await PieClient.connect(server.url, token=ALICE)
        h = await alice.upload_program(WASM)
        detached = await alice.launch(h, ["chat"], detached=True)
        owned = await alice.launch(h, ["chat"])
        async with await PieClient.connect(server.url, token=BOB) as bob:
            for iid in (detached, owned):
                with pytest.raises(PieError, match="unknown or finished instance"):
                    await bob.signal(iid, "hijack")
                with pytest.raises(PieError, match="unknown or finished instance"):
                    await bob.close_input(iid)
                with pytest.raises(PieError, match="unknown or finished instance"):
                    await bob.terminate(iid)
                with pytest.raises(PieError, match="unknown instance"):
                    await bob.attach(iid)
            await alice.close()  # the detached one is now unattached: still not bob's to take
            with pytest.raises(PieError, match="unknown instance"):
                await bob.attach(detached)
            assert not any(iid == detached for iid, _ in host.terminations)
        async with await PieClient.connect(server.url, token=ALICE) as again:
            await again.attach(detached)  # its own tenant may, from a new connection
            await again.signal(detached, "hi")
            await again.signal(detached, "quit")
            assert [(e.event, e.message) async for e in again.events(detached)] == \
                [("message", "got:hi"), ("completed", "bye")]

    asyncio.run(main())


def test_admin_attaches_any_tenants_detached_instance(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url, token=BOB) as bob:
            iid = await bob.launch(await bob.upload_program(WASM), ["chat"], detached=True)
        async with await PieClient.connect(server.url, token=ADMIN) as admin:
            await admin.attach(iid)
            await admin.signal(iid, "quit")
            assert [e.event async for e in admin.events(iid)] == ["completed"]

    asyncio.run(main())


def test_programs_are_per_tenant_and_the_admin_sees_all(server) -> None:
    h = hashlib.sha256(OTHER_WASM).hexdigest()

    async def main() -> None:
        async with (await PieClient.connect(server.url, token=ALICE) as alice,
                    await PieClient.connect(server.url, token=BOB) as bob,
                    await PieClient.connect(server.url, token=ADMIN) as admin):
            assert await alice.upload_program(OTHER_WASM) == h
            assert await alice.program_exists(h) and await admin.program_exists(h)
            assert not await bob.program_exists(h)
            with pytest.raises(PieError, match="unknown program"):
                await bob.launch(h, ["echo"])
            iid = await admin.launch(h, ["echo", "x"])  # the admin may launch any stored program
            assert [e.event async for e in admin.events(iid)] == ["message", "completed"]
            assert await bob.upload_program(OTHER_WASM) == h  # bob's own copy: the bytes, uploaded by bob
            assert await bob.program_exists(h)
            iid = await bob.launch(h, ["echo", "y"])
            assert [e.message async for e in bob.events(iid)] == ["y", "done"]
        assert server.store.path(h).is_file() and len(server.store.hashes()) == 1  # one file for both

    asyncio.run(main())


@pytest.mark.parametrize("record", ["../../../../etc/passwd", "x" * 100_000, "A" * 64, "0" * 63, 5, None])
def test_program_exists_takes_only_a_hash(server, record) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url, token=ALICE) as alice:
            with pytest.raises(PieError, match="64 lowercase hex digits") as info:
                await alice.query("program_exists", record)
            assert len(str(info.value)) < 300 and "internal" not in str(info.value)
            assert await alice.ping() >= 0

    asyncio.run(main())


def test_a_connection_stays_the_tenant_it_authenticated_as(server) -> None:
    async def main() -> None:
        async with await PieClient.connect(server.url, token=ALICE) as alice:
            with pytest.raises(PieError, match="already authenticated as another tenant"):
                await alice.authenticate(BOB)
            await alice.authenticate(ALICE)  # the same token again is fine
            h = await alice.upload_program(WASM)
            iid = await alice.launch(h, ["hold"])
            assert [i["tenant"] for i in await alice.query("instances")] == ["alice"]
            await alice.terminate(iid)

    asyncio.run(main())


def test_store_quota_evicts_a_tenants_least_recently_used_programs(tmp_path) -> None:
    compiled: list[str] = []

    def compile_fn(data: bytes) -> str:
        compiled.append(hashlib.sha256(data).hexdigest())
        return compiled[-1]

    clock = [1000.0]
    store = ProgramStore(tmp_path, compile_fn, (ValueError,), quota_bytes=250, ttl_s=3600, clock=lambda: clock[0])
    a, b, c = (store.put(bytes([i]) * 100, "alice") for i in range(3))
    store.put(bytes([9]) * 100, "bob")
    assert store.tenant_bytes("alice") <= 250
    assert not store.visible("alice", a) and store.visible("alice", b) and store.visible("alice", c)
    assert not store.path(a).exists()  # nobody owns it any more: the file went
    assert store.visible("bob", hashlib.sha256(bytes([9]) * 100).hexdigest())  # bob's quota is his own
    clock[0] += 10
    store.touch("alice", b)  # launched: b is now the most recently used
    store.put(bytes([3]) * 100, "alice")
    assert store.visible("alice", b) and not store.visible("alice", c)


def test_programs_not_launched_for_the_ttl_are_evicted_and_it_survives_restarts(tmp_path) -> None:
    clock = [1000.0]

    def make() -> ProgramStore:
        return ProgramStore(tmp_path, lambda d: hashlib.sha256(d).hexdigest(), (ValueError,), ttl_s=100,
                            clock=lambda: clock[0])

    store = make()
    old, kept = store.put(b"old program", "alice"), store.put(b"kept program", "alice")
    shared = store.put(b"shared program", "bob")
    store.put(b"shared program", "alice")
    clock[0] += 80
    store.touch("alice", kept)
    store.touch("alice", shared)
    store = make()  # a restart reads the owners back from disk
    assert store.visible("alice", old) and store.visible("bob", shared)
    clock[0] += 50  # old: 130 s unused; kept, shared (alice): 50 s; shared (bob): 130 s
    assert store.sweep(force=True) == 2
    assert not store.visible("alice", old) and not store.path(old).exists()
    assert store.visible("alice", kept) and store.visible("alice", shared) and not store.visible("bob", shared)
    assert store.path(shared).exists()  # alice still owns it


@pytest.mark.build
def test_kv_pages_per_tenant_are_capped_and_another_tenant_is_not_starved(tmp_path: Path) -> None:
    """--max-pages-per-tenant 6 on a cache of 16: alice's second 4-page instance is refused its
    pages (its instance ends with the reason), bob's get theirs."""
    from fakes import FakeBackend
    from helpers import wasm_bytes

    from host import Host, HostConfig

    host = Host(HostConfig(data_dir=tmp_path / "host", max_pages_per_tenant=6, warm_auto=0),
                backend=FakeBackend(page_size=4, num_pages=16))
    try:
        with running_server(tmp_path, host=host, auth_token=ADMIN, tenants=(("alice", ALICE), ("bob", BOB))) as srv:
            async def main() -> None:
                async with (await PieClient.connect(srv.url, token=ALICE) as alice,
                            await PieClient.connect(srv.url, token=BOB) as bob):
                    wasm = wasm_bytes("misbehave")
                    first = await alice.launch(await alice.upload_program(wasm), ["hog", "4"])
                    events = alice.events(first)
                    assert (await events.__anext__()).message == "holding"
                    second = await alice.launch(await alice.upload_program(wasm), ["hog", "4"])
                    end = [e async for e in alice.events(second)][-1]
                    assert end.event in ("exception", "out_of_resources") and "tenant page limit" in end.message
                    theirs = await bob.launch(await bob.upload_program(wasm), ["hog", "4"])
                    bob_events = bob.events(theirs)
                    assert (await bob_events.__anext__()).message == "holding"  # bob is not starved
                    for client, iid in ((alice, first), (bob, theirs)):
                        await client.signal(iid, "done")
                    assert [e.event async for e in events] == ["completed"]
                    assert [e.event async for e in bob_events] == ["completed"]

            asyncio.run(main())
        wait_for(lambda: host.free_pages() == 16, 10, "every page back")
    finally:
        host.shutdown()


def test_query_instances_on_a_real_host_is_per_tenant(tmp_path: Path) -> None:
    """The same over `host.Host` (stand-in backend): its `instances()` names each one's tenant."""
    from fakes import FakeBackend
    from helpers import wasm_bytes

    from host import Host, HostConfig

    host = Host(HostConfig(data_dir=tmp_path / "host", warm_auto=0), backend=FakeBackend())
    try:
        with running_server(tmp_path, host=host, auth_token=ADMIN, tenants=(("alice", ALICE), ("bob", BOB))) as srv:
            async def main() -> None:
                async with (await PieClient.connect(srv.url, token=ALICE) as alice,
                            await PieClient.connect(srv.url, token=BOB) as bob,
                            await PieClient.connect(srv.url, token=ADMIN) as admin):
                    iid = await alice.launch(await alice.upload_program(wasm_bytes("wasi_sleep")), ["--secret"])
                    assert await bob.query("instances") == []
                    assert [(i["id"], i["tenant"], i["arguments"]) for i in await admin.query("instances")] == \
                        [(iid, "alice", ["--secret"])]
                    with pytest.raises(PieError, match="unknown or finished instance"):
                        await bob.terminate(iid)
                    await alice.terminate(iid)
                    assert [e.event async for e in alice.events(iid)] == ["aborted"]

            asyncio.run(main())
    finally:
        host.shutdown()


@pytest.mark.build
def test_the_key_value_store_is_per_tenant_and_bounded(tmp_path: Path) -> None:
    """bob's inferlets neither read nor list alice's keys (the SDK keeps exported contexts' token
    histories there); a tenant's keys and values are bounded (--max-kv-store-mb)."""
    from fakes import FakeBackend
    from helpers import wasm_bytes

    from host import Host, HostConfig

    host = Host(HostConfig(data_dir=tmp_path / "host", max_kv_store_bytes=1000, warm_auto=0), backend=FakeBackend())
    try:
        with running_server(tmp_path, host=host, auth_token=ADMIN, tenants=(("alice", ALICE), ("bob", BOB))) as srv:
            async def run(client: PieClient, *args: str) -> tuple[str, str]:
                iid = await client.launch(await client.upload_program(wasm_bytes("misbehave")), list(args))
                end = [e async for e in client.events(iid)][-1]
                return end.event, end.message

            async def main() -> None:
                async with (await PieClient.connect(srv.url, token=ALICE) as alice,
                            await PieClient.connect(srv.url, token=BOB) as bob):
                    assert await run(alice, "store_put", "inferlet.context/chat", "ALICE-SECRET") == \
                        ("completed", "stored")
                    assert await run(bob, "store_read", "inferlet.context/chat") == ("completed", "None|")
                    assert await run(alice, "store_read", "inferlet.context/chat") == \
                        ("completed", "ALICE-SECRET|inferlet.context/chat")
                    event, message = await run(alice, "store_put", "big", "x" * 2000)
                    assert event == "exception" and "past its limit of 1000 bytes" in message
                    assert await run(bob, "store_put", "mine", "y" * 900) == ("completed", "stored")  # bob's own

            asyncio.run(main())
    finally:
        host.shutdown()


@pytest.mark.build
def test_pub_sub_topics_are_per_tenant(tmp_path: Path) -> None:
    """An instance of bob subscribed to "news" does not get what alice's instances publish on
    "news"; alice's own subscriber does (and sees the topic under its own name)."""
    from fakes import FakeBackend
    from helpers import Run, wasm_bytes

    from host import Host, HostConfig

    host = Host(HostConfig(data_dir=tmp_path / "host", warm_auto=0), backend=FakeBackend())
    try:
        prog = host.compile(wasm_bytes("misbehave"))
        bobs, alices = Run(host, prog, ["listen", "news"], tenant="bob"), Run(host, prog, ["listen", "news"],
                                                                              tenant="alice")
        assert [r.events.get(timeout=60).message for r in (bobs, alices)] == ["subscribed", "subscribed"]
        assert Run(host, prog, ["flood", "news", "1", "3"], tenant="alice").finish(60).message == "flooded"
        assert alices.finish(60).message == "news=000"
        assert bobs.finish(60).message == "nothing"
    finally:
        host.shutdown()
