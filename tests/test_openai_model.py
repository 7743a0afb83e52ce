"""The OpenAI routes over a real Host with the built openai_chat handler (issue 14)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import wait_for, wasm_bytes
from starlette.testclient import TestClient

from host.server.metrics import ServerMetrics
from host.server.openai_api import OpenAIHandler, openai_app

pytestmark = [pytest.mark.slow, pytest.mark.build]


@pytest.fixture(scope="module")
def client(real_host: Any) -> Iterator[TestClient]:
    program = real_host.compile(wasm_bytes("openai_chat"))
    h = OpenAIHandler(real_host, program, real_host.model_name,
                      ServerMetrics(real_host.stats, lambda: 0))
    with TestClient(openai_app(h)) as c:
        yield c


def test_chat_n2_greedy_length_and_stream_matches(client: TestClient, real_host: Any) -> None:
    base = {"model": real_host.model_name, "messages": [{"role": "user", "content": "Name a colour."}],
            "max_tokens": 6, "temperature": 0, "n": 2}
    r = client.post("/v1/chat/completions", json=base).json()
    texts = [c["message"]["content"] for c in r["choices"]]
    assert texts[0] == texts[1] and texts[0]
    assert {c["finish_reason"] for c in r["choices"]} <= {"length", "stop"}
    assert r["usage"]["completion_tokens"] <= 12 and r["usage"]["prompt_tokens"] > 0
    s = client.post("/v1/chat/completions", json={**base, "n": 1, "stream": True}).text
    chunks = [json.loads(e[6:]) for e in s.split("\n\n") if e and e != "data: [DONE]"]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert streamed == texts[0] and s.rstrip().endswith("data: [DONE]")
    # (the handler's last decode-step run ahead, never claimed, holds its pages until it has run)
    wait_for(lambda: real_host.free_pages() == real_host.total_pages, 5, "the handler's pages back")


def test_stop_string_not_included(client: TestClient, real_host: Any) -> None:
    body = {"model": real_host.model_name, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 12,
            "temperature": 0, "stop": [" 9"]}
    full = client.post("/v1/completions", json={**body, "stop": None}).json()["choices"][0]["text"]
    cut = client.post("/v1/completions", json=body).json()["choices"][0]
    assert " 9" in full and cut["text"] == full[: full.index(" 9")] and cut["finish_reason"] == "stop"


def test_disconnect_mid_stream_frees_pages(client: TestClient, real_host: Any) -> None:
    import asyncio

    from host.server.openai_chat import stream_completion as _stream
    from host.server.openai_request import parse_request
    from host.server.openai_run import handler_messages as _messages
    from host.server.openai_run import launch as _launch

    h = OpenAIHandler(real_host, real_host.compile(wasm_bytes("openai_chat")), real_host.model_name,
                      ServerMetrics(real_host.stats, lambda: 0))
    body = {"model": real_host.model_name, "prompt": "Once upon a time", "max_tokens": 200,
            "stream": True, "temperature": 0}
    req = parse_request(json.dumps(body).encode(), False, 4096)

    async def first_chunk_then_leave() -> tuple[str, bytes]:
        run = _launch(h, req)
        gen = _stream(h, req, False, run, _messages(run))
        chunk = await gen.__anext__()
        await gen.aclose()  # what Starlette does when the client goes away
        run.close()  # and then the response's close (_GuardedStream)
        return run.iid, chunk

    iid, chunk = asyncio.run(first_chunk_then_leave())
    assert chunk.startswith(b"data: ")
    assert b'pie_instance_ends_total{reason="client_disconnected"} 1.0' in h.metrics.render()
    assert real_host.wait(iid, timeout=30)
    deadline = time.monotonic() + 10  # an in-flight pass of the ended instance returns its pages
    while real_host.free_pages() != real_host.total_pages and time.monotonic() < deadline:
        time.sleep(0.05)
    assert real_host.free_pages() == real_host.total_pages


def test_prompt_past_the_context_or_the_kv_pages_is_context_length_exceeded(client: TestClient,
                                                                           real_host: Any) -> None:
    """Counted with the model's own tokenizer and chat template before anything is launched."""
    import dataclasses

    from host.server.openai_api import PromptBudget

    context = real_host.backend.info.max_position
    assert context > 0
    started = real_host.stats()["instances"]
    long = {"model": real_host.model_name, "messages": [{"role": "user", "content": "hello " * (context + 10)}]}
    r = client.post("/v1/chat/completions", json=long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length of {context} tokens" in r.json()["error"]["message"]
    fits = {"model": real_host.model_name, "prompt": "hello " * (context - 4000), "max_tokens": 4096}
    r = client.post("/v1/completions", json=fits)  # the prompt fits, prompt + max_tokens does not
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    budget = PromptBudget.of(real_host)
    assert budget is not None and budget.kv_tokens == real_host.total_pages * 16
    small = OpenAIHandler(real_host, real_host.compile(wasm_bytes("openai_chat")), real_host.model_name,
                          ServerMetrics(real_host.stats, lambda: 0),
                          budget=dataclasses.replace(budget, kv_tokens=4 * 16))  # 4 pages for one request
    with TestClient(openai_app(small)) as c:
        r = c.post("/v1/completions", json={"model": real_host.model_name, "prompt": "hello " * 80})
        assert r.status_code == 400 and "KV cache" in r.json()["error"]["message"]
        ok = c.post("/v1/completions", json={"model": real_host.model_name, "prompt": "Hi", "temperature": 0})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 16
    assert real_host.stats()["instances"] == started


def test_json_schema_answer_validates(client: TestClient, real_host: Any) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    body = {"model": real_host.model_name, "max_tokens": 60, "temperature": 0.7, "seed": 1,
            "messages": [{"role": "user", "content": "Give a person as JSON."}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    r = client.post("/v1/chat/completions", json=body).json()
    jsonschema.validate(json.loads(r["choices"][0]["message"]["content"]), schema)
    again = client.post("/v1/chat/completions", json=body).json()
    assert again["choices"][0]["message"]["content"] == r["choices"][0]["message"]["content"]  # seed


def test_32_concurrent_streams_complete(real_host: Any) -> None:
    import asyncio

    import httpx

    h = OpenAIHandler(real_host, real_host.compile(wasm_bytes("openai_chat")), real_host.model_name,
                      ServerMetrics(real_host.stats, lambda: 0))
    app = openai_app(h)

    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = {"model": real_host.model_name, "prompt": f"Item {i}:", "max_tokens": 8,
                "stream": True, "temperature": 0}
        return (await c.post("/v1/completions", json=body)).text

    async def all_of_them() -> list[str]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    texts = asyncio.run(all_of_them())
    assert len(texts) == 32 and all(t.rstrip().endswith("data: [DONE]") for t in texts)
    assert real_host.stats()["scheduler"]["max_batch_size"] > 1  # they batched together
