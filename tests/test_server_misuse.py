"""Bad input is a 4xx or a protocol error, never a 500 or a traceback; a client that goes away ends
what it started; per-tenant caps; shutdown gives every client its terminal event (issue 37).
From a client's side, against a live server on a scripted host."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import wait_for
from server_support import WASM, FakeHost, running_server

from host.client import PieClient, PieError
from host.server.openai_api import PromptBudget

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def host() -> FakeHost:
    return FakeHost()


@pytest.fixture
def server(tmp_path: Path, host: FakeHost):
    with running_server(tmp_path, host=host, openai=True) as srv:
        yield srv


def _error_object(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text and "backtrace" not in r.text
    return body["error"]


@pytest.mark.parametrize("raw, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"model": "fake-model", "seed": ' + b"9" * 100_000 + b"}", "not valid JSON"),
    (b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud800"}]}', "not valid Unicode"),
    (b'{"model": "fake-model", "messages": [{"role": "user", "content": "a\\udfff b"}]}', "not valid Unicode"),
    (b"\xff\xfe not utf-8", "not valid JSON"),
])
def test_hostile_json_bodies_are_400(server, raw: bytes, words: str) -> None:
    r = httpx.post(f"{server.http_url}/v1/chat/completions", content=raw, timeout=30)
    assert r.status_code == 400, r.text[:300]
    assert words in _error_object(r)["message"]
    assert httpx.get(f"{server.http_url}/health").status_code == 200


def test_a_failing_handler_is_a_500_without_its_backtrace(server) -> None:
    r = httpx.post(f"{server.http_url}/v1/chat/completions",
                   json={**CHAT, "messages": [{"role": "user", "content": "crash"}]}, timeout=10)
    assert r.status_code == 500
    error = _error_object(r)
    assert "the server's log has the reason" in error["message"] and "Rust panic" not in r.text


def test_prompt_past_the_context_is_context_length_exceeded(tmp_path: Path, host: FakeHost) -> None:
    budget = PromptBudget(count=lambda req: len((req.prompt or req.messages[-1]["content"]).split()),
                          context=100, kv_tokens=1000)
    with running_server(tmp_path, host=host, openai=True) as srv:
        assert srv.openai is not None
        srv.openai.budget = budget
        url = f"{srv.http_url}/v1/completions"
        r = httpx.post(url, json={"model": "fake-model", "prompt": "w " * 150})
        assert r.status_code == 400
        error = _error_object(r)
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
        assert "maximum context length of 100 tokens" in error["message"]
        r = httpx.post(url, json={"model": "fake-model", "prompt": "w " * 60, "max_tokens": 50})
        assert r.status_code == 400 and _error_object(r)["code"] == "context_length_exceeded"
        srv.openai.budget = PromptBudget(budget.count, context=100, kv_tokens=40)  # the KV cache is smaller
        r = httpx.post(f"{srv.http_url}/v1/chat/completions",
                       json={**CHAT, "messages": [{"role": "user", "content": "w " * 60}]})
        assert r.status_code == 400 and "KV cache" in _error_object(r)["message"]
        assert _error_object(r)["param"] == "messages"
        assert not host.running and host.terminations == []  # nothing was launched for them
        r = httpx.post(url, json={"model": "fake-model", "prompt": "w " * 10})  # max_tokens cut to fit
        assert r.status_code == 200
        assert json.loads(host.args_seen[-1])["max_tokens"] == 16


def test_a_chat_template_that_refuses_the_messages_is_400(server) -> None:
    import jinja2

    def refuse(req: object) -> int:
        raise jinja2.TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    assert server.openai is not None
    server.openai.budget = PromptBudget(refuse, context=100, kv_tokens=1000)
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=CHAT)
    assert r.status_code == 400 and "roles must alternate" in _error_object(r)["message"]
    assert _error_object(r)["param"] == "messages"


def test_prompt_budget_lowers_an_unasked_max_tokens_to_what_fits() -> None:
    from host.server.openai_request import parse_request

    budget = PromptBudget(count=lambda req: 90, context=100, kv_tokens=1000)
    req = budget.check(parse_request(json.dumps(CHAT).encode(), True, 4096))
    assert req.max_tokens == 10
    asked = parse_request(json.dumps({**CHAT, "max_tokens": 10}).encode(), True, 4096)
    assert budget.check(asked) == asked


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_client_that_goes_away_ends_its_instance_within_a_second(server, host, stream: bool) -> None:
    body = {**CHAT, "stream": stream, "messages": [{"role": "user", "content": "hold"}]}

    def ask() -> None:
        with pytest.raises(httpx.ReadTimeout):
            with httpx.stream("POST", f"{server.http_url}/v1/chat/completions", json=body, timeout=0.5) as r:
                for _ in r.iter_raw():
                    pass

    ask()  # the client gives up after 0.5 s and closes its connection
    gone = time.monotonic()
    wait_for(lambda: any(why == "client went away" for _, why in host.terminations), 5, "the instance to end")
    assert time.monotonic() - gone < 1.5
    wait_for(lambda: not host.running, 5, "its pages to come back")
    assert host.free_pages() == host.total_pages


@pytest.mark.parametrize("abrupt", [False, True])
def test_a_websocket_client_that_goes_away_ends_its_instances_within_a_second(server, host, abrupt: bool) -> None:
    """Closed cleanly or dropped without a close frame (abrupt): its instances are terminated at
    once, except the detached one (docs/protocol.md)."""
    async def main() -> tuple[str, str]:
        client = await PieClient.connect(server.url)
        h = await client.upload_program(WASM)
        owned = await client.launch(h, ["hold"])
        detached = await client.launch(h, ["hold"], detached=True)
        if abrupt:
            client._ws.transport.abort()  # the TCP connection just goes (no close frame)
        await client.close()
        return owned, detached

    owned, detached = asyncio.run(main())
    gone = time.monotonic()
    wait_for(lambda: (owned, "client disconnected") in host.terminations, 5, "the owned instance to end")
    assert time.monotonic() - gone < 1.5
    assert detached in host.running and all(iid != detached for iid, _ in host.terminations)
    host.terminate(detached, "test over")


def test_per_tenant_instance_cap_over_websocket_and_http(tmp_path: Path, host: FakeHost) -> None:
    with running_server(tmp_path, host=host, openai=True, auth_token="adm",
                        tenants=(("alice", "a"), ("bob", "b")), max_instances_per_tenant=2) as srv:
        async def main() -> None:
            async with (await PieClient.connect(srv.url, token="a") as alice,
                        await PieClient.connect(srv.url, token="b") as bob):
                h = await alice.upload_program(WASM)
                held = [await alice.launch(h, ["hold"]) for _ in range(2)]
                with pytest.raises(PieError, match="tenant 'alice' runs its maximum of 2 instances"):
                    await alice.launch(h, ["hold"])
                r = await asyncio.to_thread(httpx.post, f"{srv.http_url}/v1/chat/completions", json=CHAT,
                                            headers={"Authorization": "Bearer a"})
                assert r.status_code == 429 and _error_object(r)["code"] == "rate_limit_exceeded"
                r = await asyncio.to_thread(httpx.post, f"{srv.http_url}/v1/chat/completions", json=CHAT,
                                            headers={"Authorization": "Bearer b"})
                assert r.status_code == 200  # bob is not starved by alice
                iid = await bob.launch(await bob.upload_program(WASM), ["echo"])
                assert [e.event async for e in bob.events(iid)] == ["completed"]
                await alice.terminate(held[0])
                assert [e.event async for e in alice.events(held[0])] == ["aborted"]
                again = await alice.launch(h, ["echo"])  # one ended: alice may launch again
                assert [e.event async for e in alice.events(again)] == ["completed"]

        asyncio.run(main())


def test_shutdown_gives_every_client_its_terminal_event_first(tmp_path: Path, host: FakeHost) -> None:
    server_cm = running_server(tmp_path, host=host, openai=True)
    srv = server_cm.__enter__()
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:
        body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "hold"}]}
        with httpx.stream("POST", f"{srv.http_url}/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                started.set()
                if line:
                    lines.append(line)

    reader = threading.Thread(target=stream)
    reader.start()

    async def main() -> list[tuple[str, str]]:
        async with await PieClient.connect(srv.url) as client:
            iid = await client.launch(await client.upload_program(WASM), ["hold"])
            assert started.wait(10)
            await asyncio.to_thread(server_cm.__exit__, None, None, None)  # SIGTERM's path: Server.stop
            return [(e.event, e.message) async for e in client.events(iid)]

    assert asyncio.run(main()) == [("aborted", "server shutting down")]
    reader.join(10)
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: "):])["error"]
    assert "server shutting down" in error["message"] and error["code"] == "aborted"


def test_a_full_host_is_a_clear_error_not_an_internal_one(tmp_path: Path) -> None:
    host = FakeHost(max_running=1)
    with running_server(tmp_path, host=host, openai=True) as srv:
        async def main() -> None:
            async with await PieClient.connect(srv.url) as client:
                h = await client.upload_program(WASM)
                iid = await client.launch(h, ["hold"])
                with pytest.raises(PieError) as busy:
                    await client.launch(h, ["hold"])
                assert "maximum of 1 instances" in str(busy.value) and "internal" not in str(busy.value)
                r = await asyncio.to_thread(httpx.post, f"{srv.http_url}/v1/chat/completions", json=CHAT)
                assert r.status_code == 503 and _error_object(r)["code"] == "overloaded"
                await client.terminate(iid)
                assert [e.event async for e in client.events(iid)] == ["aborted"]
                again = await client.launch(h, ["echo"])  # the tenant's count came back after each refusal
                assert [e.event async for e in client.events(again)] == ["completed"]
            assert not srv.limits.instances  # every launch, refused or ended, gave its count back

        asyncio.run(main())


def test_a_bug_in_a_route_is_a_500_error_object_without_a_traceback(server, host, monkeypatch) -> None:
    def broken(*args: object, **kw: object) -> str:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(host, "launch", broken)
    r = httpx.post(f"{server.http_url}/v1/chat/completions", json=CHAT)
    assert r.status_code == 500 and "secret internal detail" not in r.text
    assert _error_object(r)["type"] == "server_error"
    assert httpx.get(f"{server.http_url}/health").status_code == 200
