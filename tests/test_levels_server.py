"""Priorities at the user-facing boundaries (issue 52): the protocol's launch message, the OpenAI
routes' `priority`, `pie-run --priority`; bad values are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from fakes import FakeBackend
from helpers import wait_for, wasm_bytes
from server_support import exchange, running_server
from test_openai_routes import CHAT, FakeHost, _client

from host import Host, HostConfig
from host.cli import run as cli_run
from host.client import PieError, SyncPieClient
from host.client.protocol import LaunchInstance, ProtocolError, decode_request, pack
from host.server.openai_errors import OpenAIError
from host.server.openai_request import parse_request

HASH = "0" * 64


def _launch_frame(**kw: Any) -> bytes:
    return pack({"type": "launch_instance", "corr_id": 1, "program_hash": HASH, "arguments": [], **kw})


def test_the_launch_message_takes_a_priority_and_names_a_bad_one() -> None:
    assert decode_request(_launch_frame()) == LaunchInstance(1, HASH, ())
    assert decode_request(_launch_frame(priority=-5)).priority == -5  # type: ignore[union-attr]
    for bad in (1001, -1001, "1", 1.5, True):
        with pytest.raises(ProtocolError, match="field 'priority' must be an integer from -1000 to 1000"):
            decode_request(_launch_frame(priority=bad))


@pytest.mark.parametrize("bad", ["high", 1.5, True, 1001, -1001])
def test_openai_priority_out_of_range_or_of_the_wrong_type_is_a_400_naming_it(bad: object) -> None:
    body = json.dumps({**CHAT, "priority": bad}).encode()
    with pytest.raises(OpenAIError) as e:
        parse_request(body, True, 100)
    assert e.value.status == 400 and e.value.param == "priority" and "priority" in e.value.message
    assert parse_request(json.dumps({**CHAT, "priority": -3}).encode(), True, 100).priority == -3


class _Prioritized(FakeHost):
    def __init__(self) -> None:
        super().__init__()
        self.priorities: list[int] = []

    def launch(self, program: str, args: list[str], on_event: Any, tenant: str = "local", priority: int = 0) -> str:
        self.priorities.append(priority)
        assert "priority" not in json.loads(args[0])  # the host's business, not the handler's
        return super().launch(program, args, on_event, tenant)


def test_openai_routes_launch_with_the_requests_priority() -> None:
    host = _Prioritized()
    c = _client(host)
    assert c.post("/v1/chat/completions", json={**CHAT, "priority": 7}).status_code == 200
    assert c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "priority": -2}).status_code == 200
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert host.priorities == [7, -2, 0]
    r = c.post("/v1/chat/completions", json={**CHAT, "priority": "urgent"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


def test_a_launch_over_the_protocol_runs_at_its_priority(tmp_path: Path) -> None:
    host = Host(HostConfig(warm_auto=0, data_dir=tmp_path / "h"), backend=FakeBackend(page_size=4, num_pages=64))
    try:
        with running_server(tmp_path / "s", host=host) as srv, SyncPieClient(srv.url) as client:
            prog = client.upload_program(wasm_bytes("blocked_receive"))
            iid = client.launch(prog, [], priority=-4)
            wait_for(lambda: any(i["id"] == iid for i in host.instances()), 30)
            assert next(i for i in host.instances() if i["id"] == iid)["priority"] == -4
            with pytest.raises(PieError, match="priority"):
                client.launch(prog, [], priority=5000)
            client.terminate(iid)
    finally:
        host.shutdown()


def test_a_bad_priority_frame_gets_an_error_response_naming_it(tmp_path: Path) -> None:
    import asyncio

    with running_server(tmp_path) as srv:
        reply = asyncio.run(exchange(srv.url, _launch_frame(priority="soon")))
    assert reply["successful"] is False and "priority" in reply["result"]
    assert msgpack.packb(reply)  # a plain response frame


def test_pie_run_priority_out_of_range_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("5000", "x"):
        with pytest.raises(SystemExit) as e:
            cli_run.main(["text_completion", "--priority", bad])
        assert e.value.code == 2
        assert "--priority" in capsys.readouterr().err


def test_metrics_show_depth_waits_and_aged_promotions_per_priority_and_tenant(tmp_path: Path) -> None:
    from test_metrics import _samples, _stats

    from host.server.metrics import ServerMetrics

    host = Host(HostConfig(max_instances=1, warm_auto=0, data_dir=tmp_path / "h"),
                backend=FakeBackend(page_size=4, num_pages=64))
    try:
        prog = host.compile(wasm_bytes("blocked_receive"))
        first = host.launch(prog, [])
        host.launch(prog, [], tenant="A", priority=3)
        levels = host.stats()["levels"]
        assert levels["launch_queue"]["by_priority"]["3"]["queued"] == 1
        assert set(levels["forwards"]) == {"aged", "by_priority", "by_tenant"}
        s = _samples(ServerMetrics(lambda: {**_stats(), "levels": host.stats()["levels"]}, lambda: 0))
        assert s["pie_level_queued{by=priority}{level=3}{queue=launch}"] == 1
        assert s["pie_level_queued{by=tenant}{level=A}{queue=launch}"] == 1
        host.terminate(first)
        wait_for(lambda: host.stats()["levels"]["launch_queue"]["by_tenant"]["A"]["count"] == 1, 30)
        s = _samples(ServerMetrics(lambda: {**_stats(), "levels": host.stats()["levels"]}, lambda: 0))
        assert s["pie_level_waits_total{by=tenant}{level=A}{queue=launch}"] == 1
        assert s["pie_level_aged_promotions_total{queue=forward}"] == 0
    finally:
        host.shutdown()


def test_the_stats_query_shows_a_tenant_its_own_queue_row_only(tmp_path: Path) -> None:
    host = Host(HostConfig(max_instances=1, warm_auto=0, data_dir=tmp_path / "h"),
                backend=FakeBackend(page_size=4, num_pages=64))
    try:
        prog = host.compile(wasm_bytes("blocked_receive"))
        host.launch(prog, [])
        host.launch(prog, [], tenant="alice", priority=2)
        host.launch(prog, [], tenant="bob")
        with running_server(tmp_path / "s", host=host, auth_token="adm", tenants=(("alice", "tok-a"),)) as srv:
            with SyncPieClient(srv.url, token="tok-a") as alice:
                lq = alice.query("stats")["host"]["levels"]["launch_queue"]
            with SyncPieClient(srv.url, token="adm") as admin:
                everyone = admin.query("stats")["host"]["levels"]["launch_queue"]
        assert set(lq["by_tenant"]) == {"alice"} and lq["by_tenant"]["alice"]["queued"] == 1
        assert lq["by_priority"]["2"]["queued"] == 1
        assert {"alice", "bob"} <= set(everyone["by_tenant"])
    finally:
        host.shutdown()
