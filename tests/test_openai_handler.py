"""The openai_chat handler inferlet on the SDK's fake host (issue 14), no model."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
from helpers import load_app
from inferlet.testing import FakeHost


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(page_size=4, num_pages=64).install()


def _app() -> ModuleType:
    return load_app("openai_chat", "oc_app")


def _bytes(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def _run(host: FakeHost, **req: Any) -> list[dict[str, Any]]:
    body = {"prompt": "hi", "max_tokens": 20, "temperature": 0.0, **req}
    _app().main([json.dumps(body)])
    return [json.loads(m) for m in host.messaging.sent]


def test_stop_string_cut_across_tokens_and_streamed_without_it(host: FakeHost) -> None:
    host.forward.script = _bytes("Paris END more") + [2]
    msgs = _run(host, stop=["END"], stream=True)
    deltas = "".join(m["delta"] for m in msgs if "delta" in m)
    final = next(m for m in msgs if "text" in m)
    assert final["text"] == "Paris " and deltas == "Paris " and final["finish_reason"] == "stop"
    assert msgs[-1]["usage"]["prompt_tokens"] > 0 and not host.kv.held


def test_length_finish_reason(host: FakeHost) -> None:
    host.forward.script = _bytes("abcdefgh") + [2]
    final = next(m for m in _run(host, max_tokens=3) if "text" in m)
    assert final["finish_reason"] == "length" and final["completion_tokens"] == 3


def test_n_choices_and_pages_released(host: FakeHost) -> None:
    host.forward.script = (_bytes("ab") + [2]) * 2
    msgs = _run(host, n=2)
    assert [m["index"] for m in msgs if "text" in m] == [0, 1] and not host.kv.held


def test_logprobs_entries_one_per_token_in_the_text(host: FakeHost) -> None:
    import math

    host.forward.script = _bytes("abcENDxyz") + [2]
    msgs = _run(host, logprobs=True, top_logprobs=2, stop=["END"])
    final = next(m for m in msgs if "text" in m)
    assert final["text"] == "abc" and final["finish_reason"] == "stop"
    entries = final["logprobs"]
    assert [e["token"] for e in entries] == ["a", "b", "c"]  # the stop string's tokens left out
    assert [e["text_offset"] for e in entries] == [0, 1, 2]
    # the stand-in's distribution: the drawn token first with p = 0.5, then 0.25, ...
    assert all(math.isclose(e["logprob"], math.log(0.5)) for e in entries)
    assert [len(e["top_logprobs"]) for e in entries] == [2, 2, 2]
    top = entries[0]["top_logprobs"]
    assert top[0] == {"token": "a", "logprob": entries[0]["logprob"], "bytes": [97]}
    assert math.isclose(top[1]["logprob"], math.log(0.25)) and top[1]["token"] == "b"
    assert entries[1]["bytes"] == [98] and not host.kv.held


def test_logprobs_stream_deltas_carry_their_entries(host: FakeHost) -> None:
    host.forward.script = _bytes("Paris END more") + [2]
    msgs = _run(host, logprobs=True, stream=True, stop=["END"])
    deltas = [m for m in msgs if "delta" in m]
    assert "".join(m["delta"] for m in deltas) == "Paris "
    streamed = [e["token"] for m in deltas for e in m["logprobs"]]
    assert "".join(streamed) == "Paris " and all(not e["top_logprobs"] for m in deltas for e in m["logprobs"])


def test_logprobs_and_plain_paths_draw_the_same_tokens(host: FakeHost) -> None:
    host.forward.script = _bytes("same text") + [2]
    plain = next(m for m in _run(host) if "text" in m)
    host.messaging.sent.clear()
    host.forward.script = _bytes("same text") + [2]
    with_lp = next(m for m in _run(host, logprobs=True) if "text" in m)
    assert plain["text"] == with_lp["text"] == "same text"
    assert plain["completion_tokens"] == with_lp["completion_tokens"]


# ---- tool calls (issue 39) ----------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "format": "url"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture
def big() -> FakeHost:
    """Room for the tools' system text (one token per byte here)."""
    return FakeHost(page_size=16, num_pages=256).install()


def _chat(host: FakeHost, **req: Any) -> list[dict[str, Any]]:
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 120, "temperature": 0.0,
            "tools": [WEATHER, TIME], "tool_choice": "auto", **req}
    _app().main([json.dumps(body)])
    return [json.loads(m) for m in host.messaging.sent]


def _prompt(host: FakeHost) -> str:
    return host.backend.tokenizer.decode(host.forward.requests[0].tokens)


def test_required_draws_calls_under_the_tools_grammar_and_streams_them(big: FakeHost) -> None:
    host = big
    host.forward.script = _bytes('[{"name": "get_weather", "arguments": {"city": "Paris"}}]') + [2]
    msgs = _chat(host, tool_choice="required", stream=True)
    final = next(m for m in msgs if "finish_reason" in m)
    (call,) = final["tool_calls"]
    assert final["finish_reason"] == "tool_calls" and final["text"] == ""
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert call["id"].startswith("call_") and call["type"] == "function"
    streamed = [m["tool_calls"][0] for m in msgs if "tool_calls" in m and "text" not in m]
    assert streamed[0] == {"index": 0, "id": call["id"], "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}
    assert "".join(s["function"]["arguments"] for s in streamed) == call["function"]["arguments"]
    assert len(streamed) > 3  # the arguments streamed as they were drawn, not in one piece at the end
    assert "get_weather" in _prompt(host) and "<tools>" in _prompt(host)  # tiny's template has no tools: Hermes text


def test_a_named_function_without_parallel_calls_gets_exactly_one_call(big: FakeHost) -> None:
    host = big  # the grammar refuses the second call's "," (the stand-in then draws the next token it allows)
    host.forward.script = _bytes('[{"name": "get_time", "arguments": {}}, {"name": "get_time"') + [2]
    final = next(m for m in _chat(host, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                  parallel_tool_calls=False) if "finish_reason" in m)
    assert final["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in final["tool_calls"]] == ["get_time"]
    assert json.loads(final["tool_calls"][0]["function"]["arguments"]) == {}


def test_auto_parses_hermes_calls_and_keeps_plain_text_plain(big: FakeHost) -> None:
    host = big
    host.forward.script = _bytes('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>') + [2]
    final = next(m for m in _chat(host) if "finish_reason" in m)
    assert final["finish_reason"] == "tool_calls" and final["text"] == ""
    assert json.loads(final["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    host.messaging.sent.clear()
    host.forward.requests.clear()
    host.forward.script = _bytes("It is sunny.") + [2]
    msgs = _chat(host, stream=True)
    final = next(m for m in msgs if "finish_reason" in m)
    assert final == {"index": 0, "text": "It is sunny.", "finish_reason": "stop", "completion_tokens": 13}
    assert "".join(m["delta"] for m in msgs if "delta" in m) == "It is sunny."


def test_tool_results_come_back_in_the_conversation(big: FakeHost) -> None:
    host = big
    host.forward.script = _bytes("18 C.") + [2]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = _chat(host, messages=[{"role": "user", "content": "Weather in Paris?"},
                                 {"role": "assistant", "content": None, "tool_calls": [call]},
                                 {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}])
    prompt = _prompt(host)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<s>user\n<tool_response>\n18 C\n</tool_response>" in prompt
    assert next(m for m in msgs if "finish_reason" in m)["text"] == "18 C."


def test_tool_choice_none_leaves_the_tools_out(big: FakeHost) -> None:
    host = big
    host.forward.script = _bytes("Hi") + [2]
    final = next(m for m in _chat(host, tool_choice="none") if "finish_reason" in m)
    assert final["text"] == "Hi" and "tool_calls" not in final and "<tools>" not in _prompt(host)


def test_echo_logprobs_score_the_prompt_in_one_pass(host: FakeHost) -> None:
    import math

    msgs = _run(host, prompt="abc", echo=True, logprobs=True, top_logprobs=1, max_tokens=0)
    final = next(m for m in msgs if "text" in m)
    assert final["text"] == "abc" and final["finish_reason"] == "length" and final["completion_tokens"] == 0
    entries = final["logprobs"]
    assert [e["token"] for e in entries] == ["a", "b", "c"] and [e["text_offset"] for e in entries] == [0, 1, 2]
    assert entries[0]["logprob"] is None and entries[0]["top_logprobs"] is None
    # the stand-in's made-up distribution at a row: its next token n, then n + k with p = 0.5 / (k + 1)
    from inferlet.testing.tiny import next_token

    tokens = _bytes("abc")
    for i, e in enumerate(entries[1:]):
        n = next_token([(t, p) for p, t in enumerate(tokens[: i + 1])])
        k = (tokens[i + 1] - n) % host.backend.info.vocab_size
        assert math.isclose(e["logprob"], math.log(0.5 / (k + 1)), rel_tol=1e-6), e
    assert len(host.forward.requests) == 1 and not host.kv.held  # one pass, no generation


# A Hermes template that reads `tools` (as Qwen2.5's does), rendered by jinja2 as the host would.
HERMES = ("{% if tools %}<s>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
          "{% endif %}{% for m in messages %}<s>{{ m.role }}\n{{ m.content }}"
          "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture
def hermes() -> FakeHost:
    import dataclasses

    import jinja2

    host = FakeHost(page_size=16, num_pages=256)
    host.backend.info = dataclasses.replace(host.backend.info, chat_template=HERMES)
    template = jinja2.Environment().from_string(HERMES)
    host.backend.tokenizer.apply_chat_template = (  # type: ignore[method-assign]
        lambda messages, add_generation_prompt=True, tools=None: template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt))
    return host.install()


def test_a_template_with_tools_renders_them_and_its_free_text_calls_are_parsed(hermes: FakeHost) -> None:
    host = hermes
    host.forward.script = _bytes('Let me check. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>') + [2]
    call = {"id": "c0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    msgs = _chat(host, stream=True, messages=[{"role": "user", "content": "Time?"},
                                              {"role": "assistant", "content": None, "tool_calls": [call]},
                                              {"role": "tool", "tool_call_id": "c0", "content": "cold"}])
    prompt = _prompt(host)
    assert prompt.startswith("<s>system\n<tools>") and '"name": "get_time"' in prompt
    assert '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>' in prompt  # an object
    assert "<s>tool\ncold" in prompt and "<tool_response>" not in prompt  # the template's own rendering
    final = next(m for m in msgs if "finish_reason" in m)
    assert final["text"] == "Let me check." and final["finish_reason"] == "tool_calls"
    assert final["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    streamed = "".join(m["delta"] for m in msgs if "delta" in m)
    assert streamed == "Let me check." and "<tool" not in streamed  # text before the call streams, the call does not


def test_a_schema_the_compiler_refuses_is_the_clients_error_sent_before_anything(host: FakeHost) -> None:
    msgs = _run(host, response_format={"type": "json_schema", "schema": {"type": "nonsense"}}, stream=True)
    assert msgs == [{"error": {"message": msgs[0]["error"]["message"], "param": "response_format"}}]
    assert "nonsense" in msgs[0]["error"]["message"] and not host.kv.held and not host.forward.requests


@pytest.mark.parametrize("step", [1, 5, 1000])
def test_call_stream_deltas_add_up_to_the_calls_whatever_the_pieces(step: int) -> None:
    from inferlet.toolcalls import CallStream

    answer = '[{"name": "f", "arguments": {"s": "a\\"}{[", "n": [1, {"b": 2}]}}, {"name": "g", "arguments": {}}]'
    follow, deltas = CallStream(), []
    for i in range(0, len(answer), step):
        deltas += follow.feed(answer[i:i + step])
    calls = follow.complete()
    assert [c["function"]["name"] for c in calls] == ["f", "g"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"s": 'a"}{[', "n": [1, {"b": 2}]}
    heads = [d for d in deltas if "id" in d]
    assert [(d["index"], d["id"], d["function"]) for d in heads] == [
        (k, c["id"], {"name": c["function"]["name"], "arguments": ""}) for k, c in enumerate(calls)]
    for k, c in enumerate(calls):
        assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == k) == c["function"]["arguments"]
    cut = CallStream()
    cut.feed(answer[:40])  # max_tokens inside the first call's arguments: nothing complete
    assert len(cut.calls) == 1 and cut.complete() == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_answer_cut_before_its_first_call_is_its_text_streamed_or_not(big: FakeHost, stream: bool) -> None:
    big.forward.script = _bytes('[{"name": "get_weather", "argum') + [2]
    msgs = _chat(big, tool_choice="required", max_tokens=6, stream=stream)
    final = next(m for m in msgs if "finish_reason" in m)
    assert final["finish_reason"] == "length" and "tool_calls" not in final and final["text"] == '[{"nam'
    assert "".join(m["delta"] for m in msgs if "delta" in m) == (final["text"] if stream else "")
