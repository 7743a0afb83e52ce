"""Validation of OpenAI chat/completions request bodies (issue 14).

Invariant: `parse_request` returns a fully typed `OpenAIRequest` or raises `OpenAIError`
carrying the HTTP status and OpenAI's error object (`{"error": {message, type, param, code}}`),
naming the offending parameter. Nothing past this boundary re-checks the body.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["OpenAIError", "OpenAIRequest", "parse_request", "SERVER_ONLY_FIELDS"]

# Fields of `OpenAIRequest` the server keeps to itself: not in the handler's JSON argument.
SERVER_ONLY_FIELDS = ("max_tokens_given",)

_MAX_N = 16
_MAX_TOP_LOGPROBS = 20
_MAX_STOP = 4


class OpenAIError(Exception):
    """An error answered with OpenAI's error object and an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body OpenAI's clients parse."""
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class OpenAIRequest:
    """A validated request; `messages` is set for chat, `prompt` for completions."""

    model: str
    messages: tuple[dict[str, str], ...] | None
    prompt: str | None
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
    # The client gave max_tokens (or max_completion_tokens); not sent to the handler. Without it
    # the server may lower `max_tokens` to what fits the context (host/server/openai_api.py).
    max_tokens_given: bool = False

    def handler_argument(self) -> str:
        """The JSON argument the handler instance gets (docs/openai.md, "The handler is an inferlet")."""
        fields = asdict(self)
        for name in SERVER_ONLY_FIELDS:
            del fields[name]
        return json.dumps(fields)


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


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


def _messages(value: Any) -> tuple[dict[str, str], ...]:
    if not isinstance(value, list) or not value:
        raise _bad("messages", "expected a non-empty array of messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or msg.get("role") not in ("system", "user", "assistant"):
            raise _bad("messages", f"message {i} needs role system, user or assistant")
        content = msg.get("content")
        if isinstance(content, list):  # content parts: only text parts are supported
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise _bad("messages", f"message {i}: only text content parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise _bad("messages", f"message {i}: content must be a string")
        out.append({"role": msg["role"], "content": content})
    return tuple(out)


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


def parse_request(raw: bytes, chat: bool, max_tokens_limit: int) -> OpenAIRequest:
    """Parse and validate a request body; `chat` selects /v1/chat/completions rules."""
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
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"expected a model name, got {model!r}")
    messages, prompt = None, None
    if chat:
        messages = _messages(body.get("messages"))
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise _bad("prompt", f"expected a string, got {prompt!r}")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name, 16 if not chat else max_tokens_limit, 1, max_tokens_limit)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("stream", f"expected a boolean, got {stream!r}")
    logprobs, top_logprobs = _logprobs(body, chat)
    return OpenAIRequest(
        model=model, messages=messages, prompt=prompt, max_tokens=int(max_tokens or 1),
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=int(_integer(body, "top_k", 0, 0, 1 << 20) or 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=_integer(body, "seed", None, -(1 << 63), (1 << 64) - 1),
        stop=_stop(body.get("stop")), n=int(_integer(body, "n", 1, 1, _MAX_N) or 1),
        stream=stream, include_usage=_stream_options(body, stream),
        logprobs=logprobs, top_logprobs=top_logprobs,
        response_format=_response_format(body.get("response_format")),
        max_tokens_given=body.get(name) is not None,
    )
