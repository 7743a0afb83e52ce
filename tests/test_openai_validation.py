"""Fast tests of OpenAI request validation and SSE framing (issue 14), no model."""

from __future__ import annotations

import json

import pytest

from host.server.openai_errors import OpenAIError
from host.server.openai_request import parse_request
from host.server.sse import DONE, chat_chunk, sse_event

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def _chat(**kw: object) -> bytes:
    return json.dumps({**CHAT, **kw}).encode()


def test_defaults_and_fields() -> None:
    req = parse_request(_chat(max_tokens=5, stop="\n", n=2, seed=3, stream=True,
                              stream_options={"include_usage": True}), True, 100)
    assert req.max_tokens == 5 and req.stop == ("\n",) and req.n == 2 and req.seed == 3
    assert req.include_usage and req.messages == ({"role": "user", "content": "hi"},)


def test_max_completion_tokens_wins() -> None:
    assert parse_request(_chat(max_completion_tokens=7), True, 100).max_tokens == 7


def test_completion_prompt_and_logprobs() -> None:
    body = json.dumps({"model": "m", "prompt": ["x"], "logprobs": 2}).encode()
    req = parse_request(body, False, 100)
    assert req.prompt == "x" and req.logprobs and req.top_logprobs == 2 and req.max_tokens == 16


@pytest.mark.parametrize("kw,param", [
    ({"temperature": "hot"}, "temperature"), ({"temperature": 3}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"n": True}, "n"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 101}, "max_tokens"),
    ({"stop": [1]}, "stop"), ({"stop": ["a"] * 5}, "stop"), ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ({"model": 3}, "model"), ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_bad_parameter_named(kw: dict[str, object], param: str) -> None:
    with pytest.raises(OpenAIError) as e:
        parse_request(_chat(**kw), True, 100)
    assert e.value.status == 400 and e.value.param == param
    body = e.value.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and param in body["message"]


def test_malformed_json() -> None:
    with pytest.raises(OpenAIError) as e:
        parse_request(b"{not json", True, 100)
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"


def test_response_format_schema() -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert parse_request(_chat(response_format=rf), True, 100).response_format == {
        "type": "json_schema", "schema": {"type": "object"}}


def test_sse_framing() -> None:
    event = sse_event(chat_chunk("id", 1, "m", 0, {"content": "a"}))
    assert event.startswith(b"data: {") and event.endswith(b"\n\n")
    payload = json.loads(event[len(b"data: "):])
    assert payload["object"] == "chat.completion.chunk"
    assert payload["choices"][0]["delta"] == {"content": "a"}
    assert DONE == b"data: [DONE]\n\n"
