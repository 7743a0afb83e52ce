"""Tool calls, /v1/responses, schema leniency and echo logprobs (issue 39) through the real routes and
the real openai_chat handler, run on the SDK's fake host (a toy model, no wasm): the official `openai`
client talks to the Starlette app in process. The real model and pie-serve: tests/test_openai_agents.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import openai
import pytest
from helpers import load_app
from inferlet.testing import FakeHost
from starlette.testclient import TestClient

from host.events import InstanceEvent
from host.server.metrics import ServerMetrics
from host.server.openai_api import OpenAIHandler, openai_app

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6, "format": "url"},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
MODEL = "tiny"


class HandlerHost:
    """Runs the openai_chat handler for each launch on the SDK's fake host (one at a time: the fake
    host is process-global), its messages becoming the instance's events."""

    lock = threading.Lock()

    def __init__(self) -> None:
        self.args: list[dict[str, Any]] = []

    def launch(self, program: str, args: list[str], on_event: Callable[[InstanceEvent], None],
               tenant: str = "local") -> str:
        self.args.append(json.loads(args[0]))

        def play() -> None:
            with self.lock:
                host = FakeHost(page_size=16, num_pages=512).install()
                host.messaging.send = lambda m: on_event(InstanceEvent("i1", "message", m))  # type: ignore[method-assign]
                try:
                    load_app("openai_chat", "oc_tools_app").main(args)
                except Exception as e:  # the instance's trap
                    on_event(InstanceEvent("i1", "exception", repr(e)))
                    return
            on_event(InstanceEvent("i1", "completed", ""))
        threading.Thread(target=play).start()
        return "i1"

    def terminate(self, iid: str, reason: str) -> None:
        pass


@pytest.fixture
def served() -> Iterator[tuple[openai.OpenAI, HandlerHost, TestClient]]:
    host = HandlerHost()
    http = TestClient(openai_app(OpenAIHandler(host, "hash", MODEL, ServerMetrics(dict, lambda: 0))))
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0), host, http


def _valid(call: Any) -> dict[str, Any]:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    args: dict[str, Any] = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_parse_and_validate(served: Any, choice: Any) -> None:
    client, host, _ = served
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                       parallel_tool_calls=False, max_tokens=200, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None and len(c.message.tool_calls or []) == 1
    call = (c.message.tool_calls or [])[0]
    assert call.id.startswith("call_") and call.type == "function"
    _valid(call)
    if isinstance(choice, dict):
        assert call.function.name == "get_weather"
    assert host.args[-1]["tool_choice"] == choice and host.args[-1]["tools"] == TOOLS


def test_streamed_tool_calls_assemble_to_the_non_streamed_ones(served: Any) -> None:
    client, _, _ = served
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=0,
              parallel_tool_calls=False)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls  # type: ignore[call-overload]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):  # type: ignore[call-overload]
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += (d.function.name or "") if d.function else ""
            c["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and len(calls) == len(whole) >= 1
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [(w.function.name, w.function.arguments)
                                                                     for w in whole]


def test_auto_and_none_and_a_two_turn_tool_conversation(served: Any) -> None:
    client, host, _ = served
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=30,
                                       temperature=0)
    c = r.choices[0]  # the toy model writes letters: text (a "<" would have to begin a valid call)
    assert c.finish_reason in ("stop", "length", "tool_calls")
    for call in c.message.tool_calls or []:
        _valid(call)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=200, parallel_tool_calls=False)
    msg = first.choices[0].message
    call = (msg.tool_calls or [])[0]
    second = client.chat.completions.create(model=MODEL, max_tokens=5, tools=TOOLS, messages=[
        *ASK, msg.model_dump(exclude_none=True),  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 18 C"}])
    assert second.choices[0].message.content is not None
    sent = host.args[-1]["messages"]
    assert sent[1]["tool_calls"][0]["id"] == call.id and sent[2] == {"role": "tool", "tool_call_id": call.id,
                                                                      "content": "sunny, 18 C"}


def test_tool_errors_are_400s(served: Any) -> None:
    client, _, _ = served
    bad = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
           ({"tools": [{"type": "code_interpreter"}]}, "tools"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
               "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}]}, "tools")]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)  # type: ignore[index]
    assert "'not' at /properties/x" in str(e.value)


def test_real_world_schema_annotations_pass_and_unenforceable_keywords_are_named(served: Any) -> None:
    client, _, _ = served
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "title": "t", "$comment": "c",
              "type": "object", "properties": {"homepage": {"type": "string", "format": "url", "maxLength": 5,
                                                            "examples": ["x"], "description": "d"}},
              "required": ["homepage"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=60)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), {**schema, "properties": {
        "homepage": {"type": "string", "maxLength": 5}}})
    schema["if"], schema["then"] = {"required": ["homepage"]}, {"minProperties": 1}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, response_format=fmt, max_tokens=5)  # type: ignore[arg-type]
    assert e.value.body["param"] == "response_format" and "'if' at /" in e.value.body["message"]  # type: ignore[index]


def test_responses_object_stream_and_previous_response_id(served: Any) -> None:
    client, host, _ = served
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = client.responses.create(model=MODEL, input="Weather in Paris?", instructions="Be brief.", tools=tools,  # type: ignore[arg-type]
                                tool_choice="required", max_output_tokens=200, parallel_tool_calls=False)
    assert r.status == "completed" and r.object == "response" and r.usage and r.usage.output_tokens > 0
    (fc,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(fc.arguments), WEATHER)  # type: ignore[union-attr]
    assert host.args[-1]["messages"][0] == {"role": "system", "content": "Be brief."}
    r2 = client.responses.create(model=MODEL, previous_response_id=r.id, max_output_tokens=4, input=[
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])  # type: ignore[union-attr]
    msgs = host.args[-1]["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "tool"] and msgs[2]["content"] == "sunny"
    assert msgs[1]["tool_calls"][0]["id"] == fc.call_id  # type: ignore[union-attr]
    assert r2.status == "incomplete" and r2.incomplete_details and r2.output_text == r2.output[0].content[0].text  # type: ignore[union-attr]
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert "response.output_text.delta" in kinds and kinds.index("response.output_item.added") < kinds.index(
        "response.output_text.delta") < kinds.index("response.output_text.done")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_unknown")


def test_responses_stream_function_call_events(served: Any) -> None:
    client, _, _ = served
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                          max_output_tokens=200, stream=True, parallel_tool_calls=False))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments)["days"] >= 1 and kinds[-1] == "response.completed"
    (fc,) = events[-1].response.output
    assert fc.type == "function_call" and fc.arguments == done.arguments


def test_responses_errors_have_the_error_shape(served: Any) -> None:
    _, _, http = served
    for body, param in [({"model": MODEL}, "input"), ({"model": MODEL, "input": [{"type": "image"}]}, "input"),
                        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens")]:
        r = http.post("/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


def test_echo_with_max_tokens_0_returns_the_prompt_logprobs(served: Any) -> None:
    client, _, _ = served
    r = client.completions.create(model=MODEL, prompt="Paris is", echo=True, logprobs=2, max_tokens=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "Paris is" and lp is not None and "".join(lp.tokens or []) == "Paris is"
    assert (lp.token_logprobs or [])[0] is None and all(x is not None and x <= 0 for x in (lp.token_logprobs or [])[1:])
    assert (lp.top_logprobs or [])[0] is None and len((lp.top_logprobs or [])[1]) == 2
    r = client.completions.create(model=MODEL, prompt="Paris is", echo=True, max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith("Paris is") and len(r.choices[0].text) > len("Paris is")


def test_response_store_is_bounded_expires_and_keeps_tenants_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    from host.server import openai_responses
    from host.server.openai_errors import OpenAIError
    from host.server.openai_responses import ResponseStore

    now = [100.0]
    monkeypatch.setattr(openai_responses.time, "monotonic", lambda: now[0])
    store = ResponseStore(max_entries=2, ttl_s=10)
    for i in range(3):
        store.put(f"r{i}", "a", [{"role": "user", "content": str(i)}])
    assert store.get("r2", "a") == [{"role": "user", "content": "2"}]
    for rid, tenant in (("r0", "a"), ("r2", "b")):  # the oldest went past the bound; another tenant's is unknown
        with pytest.raises(OpenAIError) as e:
            store.get(rid, tenant)
        assert e.value.status == 404 and e.value.param == "previous_response_id"
    now[0] += 10.5
    with pytest.raises(OpenAIError):
        store.get("r2", "a")  # expired
    small = ResponseStore(max_entries=10, ttl_s=10, max_bytes=100)
    small.put("a", "t", [{"role": "user", "content": "x" * 40}])
    small.put("b", "t", [{"role": "user", "content": "y" * 40}])  # past 100 bytes together: "a" goes
    assert small.get("b", "t") and small._bytes < 100
    with pytest.raises(OpenAIError):
        small.get("a", "t")


class RefusingHost(HandlerHost):
    """A handler that refuses every request as openai_chat refuses a schema it cannot compile."""

    def launch(self, program: str, args: list[str], on_event: Callable[[InstanceEvent], None],
               tenant: str = "local") -> str:
        on_event(InstanceEvent("i1", "message", json.dumps({"error": {"message": "tools: too big", "param": "tools"}})))
        on_event(InstanceEvent("i1", "completed", ""))
        return "i1"


def test_a_handler_refusal_is_a_400_or_the_streams_error_event() -> None:
    http = TestClient(openai_app(OpenAIHandler(RefusingHost(), "hash", MODEL, ServerMetrics(dict, lambda: 0))))
    body = {"model": MODEL, "messages": ASK}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"] == {"message": "tools: too big", "type": "invalid_request_error",
                                                          "param": "tools", "code": None}
    lines = [ln for ln in http.post("/v1/chat/completions", json={**body, "stream": True}).text.splitlines() if ln]
    assert json.loads(lines[-2][6:])["error"]["param"] == "tools" and lines[-1] == "data: [DONE]"
    r = http.post("/v1/responses", json={"model": MODEL, "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "tools: too big"
    events = [json.loads(ln[6:]) for ln in http.post("/v1/responses", json={"model": MODEL, "input": "x", "stream": True})
              .text.splitlines() if ln.startswith("data: ")]
    assert events[0]["type"] == "response.created" and events[-1]["type"] == "error"


def test_a_prompt_of_token_ids_scores_like_its_text(served: Any) -> None:
    """lm-eval's tokenized requests send the prompt as token ids (the toy model's byte tokens here)."""
    client, _, http = served
    text = client.completions.create(model=MODEL, prompt="Paris is", echo=True, logprobs=1, max_tokens=0)
    ids = [b + 3 for b in b"Paris is"]
    for prompt in (ids, [ids]):
        r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
        assert r.choices[0].text == "Paris is" and r.choices[0].logprobs == text.choices[0].logprobs
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 10**6], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "vocabulary" in r.json()["error"]["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, "x"], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
