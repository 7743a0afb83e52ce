"""The OpenAI routes over a fake host that plays the handler's messages (issue 14), no model."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from starlette.testclient import TestClient

from host.events import InstanceEvent
from host.host import HostBusy
from host.server.metrics import ServerMetrics
from host.server.openai_api import OpenAIHandler, openai_app

Listener = Callable[[InstanceEvent], None]


class FakeHost:
    """Replies to each launch with the openai_chat message sequence for the request."""

    def __init__(self, busy: bool = False) -> None:
        self.busy = busy
        self.args: list[str] = []
        self.terminated: list[str] = []
        self.tenants: list[str] = []

    def launch(self, program: str, args: list[str], on_event: Listener, tenant: str = "local") -> str:
        if self.busy:
            raise HostBusy("the host is running its maximum of 1 instances")
        self.args.append(args[0])
        self.tenants.append(tenant)
        req = json.loads(args[0])

        def entry(piece: str, offset: int) -> dict[str, Any]:
            top = [{"token": piece, "logprob": -0.5, "bytes": list(piece.encode())},
                   {"token": "x", "logprob": -1.5, "bytes": [120]}][: req["top_logprobs"]]
            return {"token": piece, "logprob": -0.5, "bytes": list(piece.encode()), "text_offset": offset,
                    "top_logprobs": top}

        def play() -> None:
            lp = [entry("Hel", 0), entry("lo", 3)] if req["logprobs"] else None
            for i in range(req["n"]):
                for k, piece in enumerate(("Hel", "lo")):
                    if req["stream"]:
                        msg: dict[str, Any] = {"index": i, "delta": piece}
                        if lp is not None:
                            msg["logprobs"] = lp[k:k + 1]
                        on_event(InstanceEvent("i1", "message", json.dumps(msg)))
                final = {"index": i, "text": "Hello", "finish_reason": "stop", "completion_tokens": 2}
                if lp is not None:
                    final["logprobs"] = lp
                on_event(InstanceEvent("i1", "message", json.dumps(final)))
            on_event(InstanceEvent("i1", "message", json.dumps(
                {"usage": {"prompt_tokens": 4, "completion_tokens": 2 * req["n"]}})))
            on_event(InstanceEvent("i1", "completed", ""))
        threading.Thread(target=play).start()
        return "i1"

    def terminate(self, iid: str, reason: str) -> None:
        self.terminated.append(iid)

    def stats(self) -> dict[str, Any]:
        sched = {"batches": 0, "forwards": 0, "tokens": 0, "backend_errors": 0, "mean_batch_size": 0}
        return {"scheduler": sched, "instances": 0, "free_pages": 8, "total_pages": 8}


def _client(host: FakeHost, token: str | None = None) -> TestClient:
    h = OpenAIHandler(host, "prog", "tiny", ServerMetrics(host.stats, lambda: 0), auth_token=token)
    return TestClient(openai_app(h))


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


def test_chat_non_streaming_n2() -> None:
    r = _client(FakeHost()).post("/v1/chat/completions", json={**CHAT, "n": 2})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "Hello"]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}


def test_completions_stream_chunks_and_done() -> None:
    body = {"model": "tiny", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    r = _client(FakeHost()).post("/v1/completions", json=body)
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["usage"]["total_tokens"] == 6


def test_errors() -> None:
    c = _client(FakeHost(), token="sekrit")
    auth = {"Authorization": "Bearer sekrit"}
    assert c.post("/v1/chat/completions", json=CHAT).status_code == 401
    r = c.post("/v1/chat/completions", json={**CHAT, "model": "nope"}, headers=auth)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = c.post("/v1/chat/completions", json={**CHAT, "top_p": 2}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = c.post("/v1/chat/completions", json={**CHAT, "logprobs": "yes"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    busy = _client(FakeHost(busy=True)).post("/v1/chat/completions", json=CHAT)
    assert busy.status_code == 503 and set(busy.json()["error"]) == {"message", "type", "param", "code"}


def test_models_health_metrics() -> None:
    c = _client(FakeHost())
    assert c.get("/v1/models").json()["data"][0]["id"] == "tiny"
    assert c.get("/health").json() == {"status": "ok"}
    c.post("/v1/chat/completions", json=CHAT)
    text = c.get("/metrics").text
    assert "pie_kv_pages_free 8.0" in text and 'pie_instance_ends_total{reason="completed"} 1.0' in text


def _openai(host: FakeHost, token: str = "k") -> Any:
    """The official client over the ASGI app (TestClient is an httpx.Client)."""
    import openai

    h = OpenAIHandler(host, "prog", "tiny", ServerMetrics(host.stats, lambda: 0), auth_token=token)
    return openai.OpenAI(base_url="http://testserver/v1", api_key=token, http_client=TestClient(openai_app(h)))


def test_logprobs_shapes_parse_with_the_openai_client() -> None:
    client = _openai(FakeHost())
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["Hel", "lo"] and content[0].bytes == [72, 101, 108]
    assert [t.token for t in content[0].top_logprobs] == ["Hel", "x"] and content[1].logprob == -0.5
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, stream=True))
    assert [c.token for ch in chunks if ch.choices and ch.choices[0].logprobs
            for c in ch.choices[0].logprobs.content] == ["Hel", "lo"]
    c = client.completions.create(model="tiny", prompt="x", logprobs=2)
    lp = c.choices[0].logprobs
    assert lp.tokens == ["Hel", "lo"] and lp.token_logprobs == [-0.5, -0.5] and lp.text_offset == [0, 3]
    assert lp.top_logprobs[0] == {"Hel": -0.5, "x": -1.5}
    streamed = list(client.completions.create(model="tiny", prompt="x", logprobs=1, stream=True))
    assert [t for ch in streamed if ch.choices and ch.choices[0].logprobs
            for t in ch.choices[0].logprobs.tokens] == ["Hel", "lo"]


def test_openai_client_errors() -> None:
    import openai
    import pytest

    host = FakeHost()
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        _openai(host).with_options(api_key="wrong").chat.completions.create(model="tiny", messages=msgs)
    with pytest.raises(openai.NotFoundError):
        _openai(host).chat.completions.create(model="other", messages=msgs)
    with pytest.raises(openai.BadRequestError) as bad:
        _openai(host).chat.completions.create(model="tiny", messages=msgs, temperature=5)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.InternalServerError) as busy:
        _openai(FakeHost(busy=True), "k").with_options(max_retries=0).chat.completions.create(
            model="tiny", messages=msgs)
    assert busy.value.status_code == 503


def test_tenant_tokens_are_bearer_keys_and_instances_act_for_the_tenant() -> None:
    host = FakeHost()
    h = OpenAIHandler(host, "prog", "tiny", ServerMetrics(host.stats, lambda: 0), auth_token="main",
                      tenants=(("alice", "a-tok"),))
    c = TestClient(openai_app(h))
    for key in ("a-tok", "main"):
        assert c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert c.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer a-to"}).status_code == 401
    assert c.get("/v1/models").status_code == 401 and c.get("/health").status_code == 200
    assert host.tenants == ["alice", "default"]
