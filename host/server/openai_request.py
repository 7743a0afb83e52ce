"""Validation of OpenAI chat/completions request bodies (issue 14).

The messages and tools of a chat request are host/server/openai_messages.py's. Invariant:
`parse_request` returns a fully typed `OpenAIRequest` or raises `OpenAIError`
carrying the HTTP status and OpenAI's error object (`{"error": {message, type, param, code}}`),
naming the offending parameter. Nothing past this boundary re-checks the body.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from gpu_backend.grammar import schema_error
from host.levels import PRIORITY_MAX, PRIORITY_MIN
from host.server.openai_errors import OpenAIError
from host.server.openai_errors import bad_param as _bad
from host.server.openai_messages import parse_messages, parse_tools

__all__ = ["OpenAIRequest", "load_body", "parse_request", "request_of", "schema_problems", "SERVER_ONLY_FIELDS"]

# Fields of `OpenAIRequest` the server keeps to itself: not in the handler's JSON argument.
SERVER_ONLY_FIELDS = ("max_tokens_given", "priority")

_MAX_N = 16
_MAX_TOP_LOGPROBS = 20
_MAX_STOP = 4


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated request; `messages` is set for chat, `prompt` for completions (its text, or its
    token ids as lm-eval's tokenized requests send them)."""

    model: str
    messages: tuple[dict[str, Any], ...] | None
    prompt: str | tuple[int, ...] | None
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = field(default=None)
    # Chat: function tools ({"type": "function", "function": {"name", "description"?, "parameters"}}),
    # tool_choice "none" / "auto" / "required" / {"type": "function", "function": {"name"}}.
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: str | dict[str, Any] = "none"
    parallel_tool_calls: bool = True
    echo: bool = False  # completions: the prompt before the text (with logprobs: the prompt's too)
    # The client gave max_tokens (or max_completion_tokens); not sent to the handler. Without it
    # the server may lower `max_tokens` to what fits the context (host/server/openai_api.py).
    max_tokens_given: bool = False
    # vLLM's: lower runs sooner (host/levels.py); the instance's priority, not the handler's business
    priority: int = 0

    def handler_argument(self) -> str:
        """The JSON argument the handler instance gets (docs/openai.md, "The handler is an inferlet")."""
        fields = asdict(self)
        for name in SERVER_ONLY_FIELDS:
            del fields[name]
        return json.dumps(fields)


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, f"expected a number, got {value!r}")
    if not lo <= value <= hi:
        raise _bad(name, f"{value!r} is out of range [{lo}, {hi}]")
    return float(value)


def _integer(body: dict[str, Any], name: str, default: int | None, lo: int, hi: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise _bad(name, f"{value!r} is out of range [{lo}, {hi}]")
    return value


def _prompt(value: Any) -> str | tuple[int, ...]:
    """A string, token ids, or a one-item list of either."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                                 for t in value):
        return tuple(value)
    raise _bad("prompt", f"expected a string or a non-empty array of token ids, got {str(value)[:100]}")


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"expected a non-empty string or an array of them, got {value!r}")
    if len(stops) > _MAX_STOP:
        raise _bad("stop", f"at most {_MAX_STOP} stop sequences, got {len(stops)}")
    return tuple(stops)


def _response_format(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _bad("response_format", "json_schema needs a json_schema.schema object")
        return {"type": "json_schema", "schema": spec["schema"]}
    raise _bad("response_format", f"type must be text, json_object or json_schema, got {kind!r}")


def _stream_options(body: dict[str, Any], stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad("stream_options", f"expected an object, got {opts!r}")
    if not stream:
        raise _bad("stream_options", "only allowed when stream is true")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise _bad("stream_options", f"include_usage must be a boolean, got {include!r}")
    return include


def _logprobs(body: dict[str, Any], chat: bool) -> tuple[bool, int]:
    raw = body.get("logprobs")
    if chat:
        if raw is not None and not isinstance(raw, bool):
            raise _bad("logprobs", f"expected a boolean, got {raw!r}")
        top = _integer(body, "top_logprobs", 0, 0, _MAX_TOP_LOGPROBS) or 0
        if top and not raw:
            raise _bad("top_logprobs", "requires logprobs to be true")
        return bool(raw), top
    count = _integer(body, "logprobs", None, 0, _MAX_TOP_LOGPROBS)
    return count is not None, count or 0


def load_body(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (OpenAIError 400 for anything else)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of more than 4300 digits
        raise OpenAIError(400, f"request body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    try:  # JSON's \ud800 escapes can make strings no UTF-8 text holds (lone surrogates)
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise OpenAIError(400, f"request body has a string that is not valid Unicode ({e.reason}: an unpaired "
                          "\\uD800-\\uDFFF escape)") from None
    except RecursionError:
        raise OpenAIError(400, "request body is nested too deeply") from None
    return body


def parse_request(raw: bytes, chat: bool, max_tokens_limit: int) -> OpenAIRequest:
    """Parse and validate a request body; `chat` selects /v1/chat/completions rules."""
    return request_of(load_body(raw), chat, max_tokens_limit)


def request_of(body: dict[str, Any], chat: bool, max_tokens_limit: int) -> OpenAIRequest:
    """Validate a parsed body (see `parse_request`)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"expected a model name, got {model!r}")
    messages, prompt = None, None
    tools, tool_choice, parallel = parse_tools(body) if chat else (None, "none", True)
    if chat:
        messages = parse_messages(body.get("messages"))
    else:
        prompt = _prompt(body.get("prompt"))
    echo = body.get("echo", False) if not chat else False
    if not isinstance(echo, bool):
        raise _bad("echo", f"expected a boolean, got {echo!r}")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    # max_tokens 0 only echoes the prompt (prompt logprobs, as lm-eval asks for them)
    max_tokens = _integer(body, name, 16 if not chat else max_tokens_limit, 0 if echo else 1, max_tokens_limit)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected a boolean, got {stream!r}")
    logprobs, top_logprobs = _logprobs(body, chat)
    return OpenAIRequest(
        model=model, messages=messages, prompt=prompt, max_tokens=int(max_tokens if max_tokens is not None else 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(_integer(body, "top_k", 0, 0, 1 << 20) or 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=_integer(body, "seed", None, -(1 << 63), (1 << 64) - 1),
        stop=_stop(body.get("stop")), n=int(_integer(body, "n", 1, 1, _MAX_N) or 1),
        stream=stream, include_usage=_stream_options(body, stream),
        logprobs=logprobs, top_logprobs=top_logprobs,
        response_format=_response_format(body.get("response_format")),
        tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel, echo=echo,
        max_tokens_given=body.get(name) is not None,
        priority=int(_integer(body, "priority", 0, PRIORITY_MIN, PRIORITY_MAX) or 0),
    )


def schema_problems(req: OpenAIRequest) -> None:
    """OpenAIError 400 when a schema of the request (response_format, a tool's parameters) uses what
    constrained generation cannot enforce, naming the keyword and its path. Annotations (`format`,
    `title`, `examples`, ...) pass. Compiles each schema without a vocabulary: run it off the event loop."""
    if req.response_format is not None and req.response_format.get("schema") is not None:
        why = schema_error(req.response_format["schema"])
        if why:
            raise _bad("response_format", f"json_schema.schema cannot be enforced: {why}")
    if req.tool_choice != "none":
        for t in req.tools or ():
            why = schema_error(t["function"]["parameters"])
            if why:
                raise _bad("tools", f"function {t['function']['name']!r}: parameters cannot be enforced: {why}")
