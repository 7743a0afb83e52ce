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

    def launch(self, program: str, args: list[str], on_event: Listener) -> str:
        if self.busy:
            raise HostBusy("the host is running its maximum of 1 instances")
        self.args.append(args[0])
        req = json.loads(args[0])

        def play() -> None:
            for i in range(req["n"]):
                for piece in ("Hel", "lo"):
                    if req["stream"]:
                        on_event(InstanceEvent("i1", "message", json.dumps({"index": i, "delta": piece})))
                on_event(InstanceEvent("i1", "message", json.dumps(
                    {"index": i, "text": "Hello", "finish_reason": "stop", "completion_tokens": 2})))
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
