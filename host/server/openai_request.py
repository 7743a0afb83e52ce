"""Validation of OpenAI chat/completions request bodies (issue 14).

Invariant: `parse_request` returns a fully typed `OpenAIRequest` or raises `OpenAIError`
carrying the HTTP status and OpenAI's error object (`{"error": {message, type, param, code}}`),
naming the offending parameter. Nothing past this boundary re-checks the body.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from gpu_backend.grammar import schema_error
from host.levels import PRIORITY_MAX, PRIORITY_MIN

__all__ = ["OpenAIError", "OpenAIRequest", "load_body", "parse_request", "parse_tools", "request_of", "schema_problems",
           "SERVER_ONLY_FIELDS"]

# Fields of `OpenAIRequest` the server keeps to itself: not in the handler's JSON argument.
SERVER_ONLY_FIELDS = ("max_tokens_given", "priority")

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


_ROLES = ("system", "developer", "user", "assistant", "tool")
_NAME = re.compile(r"^[a-zA-Z0-9_.-]{1,64}$")


def _text(content: Any, where: str) -> str:
    if isinstance(content, list):  # content parts: only text parts are supported
        if not all(isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content):
            raise _bad("messages", f"{where}: content parts must be text (or image_url, in user messages)")
        content = "".join(str(p.get("text", "")) for p in content)
    if not isinstance(content, str):
        raise _bad("messages", f"{where}: content must be a string")
    return content


_TEXT_PARTS = ("text", "input_text", "output_text")
_IMAGE_PARTS = ("image_url", "input_image")


def _user_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A user message's content: a string, or (when it has images) text and image parts in order,
    `{"type": "text", "text"}` and `{"type": "image_url", "url"}` (host/server/openai_images.py
    resolves the images). Parts: chat's `{"type": "image_url", "image_url": {"url", "detail"}}` and
    the Responses API's `{"type": "input_image", "image_url": url}`; `detail` is accepted and ignored."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
                                                 for p in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for p in content:
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in _TEXT_PARTS:
            text = p.get("text", "")
            if not isinstance(text, str):
                raise _bad("messages", f"{where}: a text part's text must be a string")
            if parts and parts[-1]["type"] == "text":
                parts[-1] = {"type": "text", "text": parts[-1]["text"] + text}
            elif text:
                parts.append({"type": "text", "text": text})
        elif kind in _IMAGE_PARTS:
            image = p.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            if not isinstance(url, str) or not url:
                raise _bad("messages", f"{where}: an image part needs image_url.url (a data: URL), got {str(image)[:100]}")
            parts.append({"type": "image_url", "url": url})
        else:
            raise _bad("messages", f"{where}: content parts must be text or image_url, got {str(kind)[:40]!r}")
    return parts


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, back in the conversation."""
    if not isinstance(value, list):
        raise _bad("messages", f"{where}: tool_calls must be an array")
    out = []
    for j, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(c.get("id", ""), str):
            raise _bad("messages", f"{where}: tool_calls[{j}] needs an id and a function with a name")
        args = fn.get("arguments", "{}")
        out.append({"id": c.get("id", ""), "type": "function",
                    "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    return out


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    """Roles system (and OpenAI's `developer`, as system), user, assistant (content null when it made
    tool_calls) and tool (a tool call's result: tool_call_id and content)."""
    if not isinstance(value, list) or not value:
        raise _bad("messages", "expected a non-empty array of messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise _bad("messages", f"message {i} needs role system, developer, user, assistant or tool")
        role = "system" if msg["role"] == "developer" else msg["role"]
        where = f"message {i}"
        m: dict[str, Any] = {"role": role}
        if role == "assistant" and msg.get("tool_calls"):
            m["tool_calls"] = _tool_calls(msg["tool_calls"], where)
            m["content"] = None if msg.get("content") is None else _text(msg["content"], where)
        elif role == "user":
            m["content"] = _user_content(msg.get("content"), where)
        else:
            content = msg.get("content")
            if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in _IMAGE_PARTS
                                                 for p in content):
                raise _bad("messages", f"{where}: only user messages may carry images")
            m["content"] = _text(content, where)
        if role == "tool":
            if not isinstance(msg.get("tool_call_id"), str):
                raise _bad("messages", f"{where}: a tool message needs the tool_call_id it answers")
            m["tool_call_id"] = msg["tool_call_id"]
        if isinstance(msg.get("name"), str):
            m["name"] = msg["name"]
        out.append(m)
    return tuple(out)


def _tools(value: Any) -> tuple[dict[str, Any], ...] | None:
    """Function tools, each {"type": "function", "function": {"name", "description"?, "parameters"?}}."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", f"expected an array of tools, got {type(value).__name__}")
    out, names = [], set()
    for i, t in enumerate(value):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise _bad("tools", f"tool {i}: only {{\"type\": \"function\", \"function\": {{...}}}} tools are supported")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise _bad("tools", f"tool {i}: the function name must be 1-64 of a-z, A-Z, 0-9, _ . -, got {name!r}")
        if name in names:
            raise _bad("tools", f"tool {i}: the function name {name!r} is used twice")
        names.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise _bad("tools", f"tool {i} ({name}): parameters must be a JSON schema object")
        f = {"name": name, "parameters": params}
        if isinstance(fn.get("description"), str):
            f["description"] = fn["description"]
        out.append({"type": "function", "function": f})
    return tuple(out) or None


def _tool_choice(value: Any, tools: tuple[dict[str, Any], ...] | None) -> str | dict[str, Any]:
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise _bad("tool_choice", f"expected none, auto, required or a named function, got {value!r}")
        if value == "required" and not tools:
            raise _bad("tool_choice", "required needs tools")
        return value if tools else "none"
    name = None
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else value.get("name")  # chat's shape, or Responses'
    if not isinstance(name, str):
        raise _bad("tool_choice", f"expected none, auto, required or {{\"type\": \"function\", \"function\": "
                   f"{{\"name\": ...}}}}, got {value!r}")
    if not any(t["function"]["name"] == name for t in tools or ()):
        raise _bad("tool_choice", f"names the function {name!r}, which is not among the tools")
    return {"type": "function", "function": {"name": name}}


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


def parse_tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None, str | dict[str, Any], bool]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a body."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"expected a boolean, got {parallel!r}")
    return tools, _tool_choice(body.get("tool_choice"), tools), parallel


def request_of(body: dict[str, Any], chat: bool, max_tokens_limit: int) -> OpenAIRequest:
    """Validate a parsed body (see `parse_request`)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"expected a model name, got {model!r}")
    messages, prompt = None, None
    tools, tool_choice, parallel = parse_tools(body) if chat else (None, "none", True)
    if chat:
        messages = _messages(body.get("messages"))
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
