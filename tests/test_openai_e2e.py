"""The OpenAI endpoint end to end (issue 14): the official `openai` client against a real `pie-serve`
subprocess on the default model, and the WebSocket protocol on the same port.

One server for the whole module (starting one costs a model load and an instance pool): token
`sk-test`, `--max-instances 33` (32 concurrent streams fit; the 34th request is refused).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
from helpers import wasm_bytes

from host.client import SyncPieClient

pytestmark = [pytest.mark.slow, pytest.mark.build]

KEY = "sk-test"
MAX_INSTANCES = 33


@dataclass
class Served:
    ws_url: str
    http_url: str
    model: str

    def client(self, **kw: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.http_url}/v1", api_key=KEY, max_retries=0, **kw)  # type: ignore[arg-type]

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.http_url}/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Wait until no instance runs and every KV page is free again; the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if m["pie_kv_pages_used"] == 0 and m["pie_instances_running"] == 0:
                return m
            assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
            time.sleep(0.1)


def _start(data: object, *extra: str) -> tuple[subprocess.Popen[str], Served]:
    """A `pie-serve` subprocess (token KEY) and where it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "host.cli.serve", "--port", "0", "--data-dir", str(data), "--auth-token", KEY,
         *extra], stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr

    def pump() -> None:
        for line in stderr:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    try:
        ws_url = None
        while ws_url is None:
            line = lines.get(timeout=300)
            assert line, "pie-serve exited before listening"
            if m := re.search(r"listening on (ws://\S+) .*HTTP (http://\S+?)[,;)]", line):
                ws_url, http_url = m.group(1), m.group(2)
        base = Served(ws_url, http_url, "")
        base.model = base.client().models.list().data[0].id
    except BaseException:
        proc.kill()
        raise
    return proc, base


def serving(data: object, *extra: str) -> Iterator[Served]:
    """`_start`'s server for a fixture's life; it must stop cleanly on SIGTERM."""
    proc, base = _start(data, *extra)
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # (no launch queue: a request past the slots is refused at once; tests/test_launch_queue.py queues)
    yield from serving(tmp_path_factory.mktemp("openai-e2e"), "--max-instances", str(MAX_INSTANCES),
                       "--launch-queue", "0", "--num-pages", "2048")


CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_health_and_chat(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list().data] == [served.model]
    assert httpx.get(f"{served.http_url}/health").json() == {"status": "ok"}
    r = client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and "Paris" in (r.choices[0].message.content or "")
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.prompt_tokens > 5 and 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_streaming_matches_non_streaming_chat_and_completions(served: Served) -> None:
    client = served.client()
    full = client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=12,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens  # type: ignore[union-attr]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    prompt = "The three primary colours are"
    done = client.completions.create(model=served.model, prompt=prompt, max_tokens=10, temperature=0)
    assert done.object == "text_completion" and done.choices[0].finish_reason == "length"
    streamed = list(client.completions.create(model=served.model, prompt=prompt, max_tokens=10, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text != ""


def test_n2_shares_the_prompt_and_answers_both(served: Served) -> None:
    client = served.client()
    greedy = client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content != ""
    sampled = list(client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=8, n=2,
                                                  temperature=1.0, seed=3, stream=True))
    assert {c.choices[0].index for c in sampled if c.choices} == {0, 1}
    assert served.wait_idle()["pie_kv_pages_used"] == 0


def test_stop_strings_cut_across_tokens(served: Served) -> None:
    client = served.client()
    body = {"model": served.model, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 12, "temperature": 0}
    full = client.completions.create(**body).choices[0].text  # type: ignore[call-overload]
    assert " 9" in full
    cut = client.completions.create(**body, stop=[" 9", "zzz"]).choices[0]  # type: ignore[call-overload]
    assert cut.text == full[: full.index(" 9")] and cut.finish_reason == "stop"
    streamed = list(client.completions.create(**body, stop=" 9", stream=True))  # type: ignore[call-overload]
    assert "".join(c.choices[0].text for c in streamed) == cut.text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seed_reproducible(served: Served) -> None:
    client = served.client()

    def draw(seed: int) -> str:
        r = client.chat.completions.create(model=served.model, max_tokens=16, temperature=1.0, seed=seed,
                                           messages=[{"role": "user", "content": "Tell me a story."}])
        return r.choices[0].message.content or ""

    first = draw(11)
    assert draw(11) == first
    assert len({first, draw(12), draw(13)}) > 1  # the seed is what fixes the draw


def test_json_schema_answer_validates(served: Served) -> None:
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = served.client().chat.completions.create(
        model=served.model, max_tokens=60, temperature=0.7, seed=1,
        messages=[{"role": "user", "content": "Give a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    obj = served.client().chat.completions.create(
        model=served.model, max_tokens=200, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "A JSON object with one key, colour."}])
    assert obj.choices[0].finish_reason == "stop", obj.choices[0].message.content
    assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)


def test_logprobs_shape_chat_and_completions(served: Served) -> None:
    client = served.client()
    r = client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=10, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].message.content or ""
    entries = r.choices[0].logprobs.content  # type: ignore[union-attr]
    assert entries and "".join(e.token for e in entries) == content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        assert e.bytes == list(e.token.encode())
        # greedy: the drawn token is the most probable one, and its logprob is that probability's log
        assert e.top_logprobs[0].token == e.token and math.isclose(e.top_logprobs[0].logprob, e.logprob)
        assert [t.logprob for t in e.top_logprobs] == sorted((t.logprob for t in e.top_logprobs), reverse=True)
        assert sum(math.exp(t.logprob) for t in e.top_logprobs) <= 1.0 + 1e-5
    plain = client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=10, temperature=0)
    assert plain.choices[0].message.content == content and plain.choices[0].logprobs is None

    # Sampled, seeded: the token-by-token path draws what the host-side loop draws.
    kw = {"model": served.model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0.8, "seed": 5}
    c = client.completions.create(**kw, logprobs=2)  # type: ignore[call-overload]
    lp = c.choices[0].logprobs
    assert c.choices[0].text == client.completions.create(**kw).choices[0].text  # type: ignore[call-overload]
    assert "".join(lp.tokens) == c.choices[0].text and len(lp.token_logprobs) == len(lp.tokens)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert all(len(d) <= 2 for d in lp.top_logprobs) and all(x <= 0 for x in lp.token_logprobs)

    chunks = list(client.chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=10,
                                                 temperature=0, logprobs=True, stream=True))
    streamed = [e.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content or []]
    assert "".join(streamed) == content


def test_errors(served: Served) -> None:
    client = served.client()
    r = httpx.post(f"{served.http_url}/v1/chat/completions", content=b"{not json",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=served.model, messages=CAPITAL, top_p=3)
    assert bad.value.status_code == 400 and bad.value.param == "top_p" and "top_p" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=served.model, prompt="x", n=0)
    assert bad.value.param == "n"
    with pytest.raises(openai.AuthenticationError) as auth:
        served.client().with_options(api_key="sk-wrong").models.list()
    assert auth.value.status_code == 401
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4o", messages=CAPITAL)
    assert missing.value.status_code == 404 and missing.value.param == "model"


def test_busy_host_answers_503_and_disconnects_free_pages(served: Served) -> None:
    """Fill every instance slot with streams, ask once more (503: the server has no launch queue),
    then leave mid-stream."""
    before = served.wait_idle()
    body = {"model": served.model, "messages": CAPITAL, "max_tokens": 2000, "stream": True,
            "temperature": 1.0, "seed": 1}
    headers = {"Authorization": f"Bearer {KEY}"}

    async def main() -> None:
        async with httpx.AsyncClient(base_url=served.http_url, headers=headers, timeout=60) as http:
            streams = [http.stream("POST", "/v1/chat/completions", json=body) for _ in range(MAX_INSTANCES)]
            responses = [await s.__aenter__() for s in streams]
            try:
                assert {r.status_code for r in responses} == {200}
                chunks = responses[0].aiter_lines()
                got = [line async for line in _take(chunks, 4)]  # the stream has started
                assert got[0].startswith("data: ")
                busy = await asyncio.to_thread(lambda: _ask_once(served))
                assert busy.status_code == 503 and busy.code == "overloaded"
            finally:
                for s in streams:  # the clients go away mid-stream
                    await s.__aexit__(None, None, None)

    asyncio.run(main())
    after = served.wait_idle()  # every instance ended and gave its pages back
    ended = after.get('pie_instance_ends_total{reason="client_disconnected"}', 0)
    assert ended - before.get('pie_instance_ends_total{reason="client_disconnected"}', 0) == MAX_INSTANCES


async def _take(lines: object, n: int) -> object:
    got = 0
    async for line in lines:  # type: ignore[attr-defined]
        if line:
            yield line
            got += 1
            if got == n:
                return


def _ask_once(served: Served) -> openai.APIStatusError:
    try:
        served.client().chat.completions.create(model=served.model, messages=CAPITAL, max_tokens=2)
    except openai.APIStatusError as e:
        return e
    raise AssertionError("a request past --max-instances was accepted")


def test_32_concurrent_streams_all_complete(served: Served) -> None:
    client = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key=KEY, max_retries=0)

    async def one(i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=served.model, prompt=f"Item {i}:", max_tokens=8,
                                                 temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main() -> list[tuple[str, str | None]]:
        async with client:
            return await asyncio.gather(*(one(i) for i in range(32)))

    before = served.metrics()
    results = asyncio.run(main())
    assert len(results) == 32 and all(reason in ("stop", "length") for _, reason in results)
    after = served.wait_idle()
    assert after["pie_instance_ends_total{reason=\"completed\"}"] - \
        before.get("pie_instance_ends_total{reason=\"completed\"}", 0) == 32
    # they ran batched together: more forwards than batches over these requests
    forwards = after["pie_forwards_total"] - before["pie_forwards_total"]
    batches = after["pie_batches_total"] - before["pie_batches_total"]
    assert forwards > 1.5 * batches
    singles = after['pie_batch_size_bucket{le="1.0"}'] - before['pie_batch_size_bucket{le="1.0"}']
    assert singles < after["pie_batch_size_count"] - before["pie_batch_size_count"]  # the histogram saw it too


def test_websocket_protocol_on_the_same_port(served: Served) -> None:
    """The handler run over protocol v1 on the same port answers what the HTTP route answers."""
    req = {"model": served.model, "messages": None, "prompt": "The capital of Italy is", "max_tokens": 6,
           "temperature": 0.0, "stream": False, "n": 1}
    with SyncPieClient(served.ws_url, token=KEY) as ws:
        assert ws.query("models") == [served.model]
        program = ws.ensure_program(wasm_bytes("openai_chat"))
        iid = ws.launch(program, [json.dumps(req)])
        events = list(ws.events(iid))
    assert events[-1].event == "completed"
    final = next(json.loads(e.message) for e in events if e.event == "message" and '"text"' in e.message)
    http = served.client().completions.create(model=served.model, prompt=req["prompt"], max_tokens=6, temperature=0)
    assert final["text"] == http.choices[0].text



def test_hostile_input_is_4xx_and_a_client_that_hangs_up_ends_its_request(served: Served) -> None:
    """Issue 37 on the real handler: a lone surrogate and a prompt past the context are 400s; a
    non-streaming request whose client hangs up ends (and frees its pages) within a second or two."""
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = f"{served.http_url}/v1/chat/completions"
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800"}]}' % served.model.encode()
    r = httpx.post(url, content=raw, headers=headers)
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        served.client().chat.completions.create(model=served.model,
                                                messages=[{"role": "user", "content": "hello " * 9000}])
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "messages"
    before = served.wait_idle()
    body = {"model": served.model, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 2000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # counting on for 2,000 tokens takes far longer than 2 s
        httpx.post(f"{served.http_url}/v1/completions", json=body, headers=headers, timeout=2.0)
    gone = time.monotonic()
    after = served.wait_idle(timeout=10)
    assert time.monotonic() - gone < 3.0
    key = 'pie_instance_ends_total{reason="client_disconnected"}'
    assert after.get(key, 0) - before.get(key, 0) == 1


def test_sigterm_gives_each_client_its_terminal_event(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Issue 37: on SIGTERM a WebSocket client gets `aborted`, an SSE client an error event and
    [DONE], before the server closes; the process exits 0."""
    proc, base = _start(tmp_path_factory.mktemp("sigterm"), "--num-pages", "512")
    try:
        body = {"model": base.model, "messages": None, "prompt": "1, 2, 3, 4, 5, 6, 7,", "max_tokens": 3000,
                "stream": True, "temperature": 0}
        lines: list[str] = []
        streaming = threading.Event()

        def sse() -> None:
            with httpx.stream("POST", f"{base.http_url}/v1/completions", json=body, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        streaming.set()

        reader = threading.Thread(target=sse)
        reader.start()
        with SyncPieClient(base.ws_url, token=KEY) as ws:
            req = {**body, "stream": False, "n": 1}
            iid = ws.launch(ws.ensure_program(wasm_bytes("openai_chat")), [json.dumps(req)])
            assert streaming.wait(60)
            proc.send_signal(signal.SIGTERM)
            events = list(ws.events(iid))
        reader.join(30)
        assert (events[-1].event, events[-1].message) == ("aborted", "server shutting down")
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][len("data: "):])["error"]["code"] == "aborted"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
