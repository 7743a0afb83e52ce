"""`POST /v1/responses` (issue 39): OpenAI's Responses API over the same handler as chat.

A Responses body becomes a chat request (`chat_body`): `input` items become messages
(`function_call` items an assistant message's `tool_calls`, `function_call_output` items `tool`
messages), `instructions` a system message, `max_output_tokens` max_tokens, `text.format`
response_format, function `tools` chat's shape. The handler's messages then become a `response`
object (`ResponseBuilder`) or its event stream (`response.created`, `response.in_progress`,
`response.output_item.added`, `response.content_part.added`, `response.output_text.delta`, ...,
`response.function_call_arguments.delta` / `.done`, `response.output_item.done`, `response.completed`).

`previous_response_id`: the server keeps each stored response's conversation (its messages, the
answer included; not its instructions, as OpenAI does) in host memory (`ResponseStore`): at most
`max_entries` (and `max_bytes` of them all), each for `ttl_s` after it was made, per tenant (another
tenant's id is unknown to it). They are lost when the server restarts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
import uuid
from typing import Any

from host.server.openai_errors import OpenAIError
from host.server.openai_errors import bad_param as _bad

__all__ = ["ResponseBuilder", "ResponseStore", "chat_body"]


@dataclasses.dataclass
class ResponseStore:
    """Stored conversations by response id, per tenant: the oldest go first past `max_entries` or
    `max_bytes`, and each expires `ttl_s` after it was stored. Thread-safe (small critical sections)."""

    max_entries: int = 1024
    ttl_s: float = 3600.0
    max_bytes: int = 256 * 2**20  # the conversations' JSON, all together (a body may be 8 MiB)
    _items: collections.OrderedDict[str, tuple[float, str, list[dict[str, Any]], int]] = dataclasses.field(
        default_factory=collections.OrderedDict)
    _bytes: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def put(self, rid: str, tenant: str, messages: list[dict[str, Any]]) -> None:
        size = len(json.dumps(messages))
        with self._lock:
            self._items[rid] = (time.monotonic() + self.ttl_s, tenant, messages, size)
            self._bytes += size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                self._drop_oldest()

    def _drop_oldest(self) -> None:
        self._bytes -= self._items.popitem(last=False)[1][3]

    def get(self, rid: str, tenant: str) -> list[dict[str, Any]]:
        """The conversation of `rid` (a 404 when unknown, expired, or another tenant's)."""
        with self._lock:
            now = time.monotonic()
            while self._items:  # expired ones first (stored in time order)
                first = next(iter(self._items.values()))
                if first[0] > now:
                    break
                self._drop_oldest()
            item = self._items.get(rid)
        if item is None or item[1] != tenant:
            raise OpenAIError(404, f"previous_response_id: no stored response {rid!r} (the server keeps "
                              f"{self.max_entries} for {self.ttl_s:.0f} s, in memory)", param="previous_response_id",
                              code="previous_response_not_found")
        return list(item[2])


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in ("input_text", "output_text", "text")
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise _bad("input", f"{where}: content must be a string or text parts (input_text / output_text)")


def _messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "expected a string or a non-empty array of input items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"item {i}"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _bad("input", f"{where}: role must be user, system, developer or assistant, got {role!r}")
            content = item.get("content")
            if role == "user" and isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                                                    for p in content):
                out.append({"role": role, "content": content})  # with images: request_of parses the parts
            else:
                out.append({"role": role, "content": _text(content, where)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            if not isinstance(call["id"], str) or not isinstance(item.get("name"), str):
                raise _bad("input", f"{where}: a function_call needs call_id and name")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise _bad("input", f"{where}: a function_call_output needs the call_id it answers")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            continue  # this server's models give none back; a client may echo another's
        else:
            raise _bad("input", f"{where}: items of type {kind!r} are not supported (message, function_call, "
                       "function_call_output)")
    return out


def _tools(value: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", "expected an array of tools")
    out = []
    for i, t in enumerate(value):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise _bad("tools", f"tool {i}: only function tools are supported, got {kind!r}")
        fn = {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's response_format."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise _bad("text", f"format.type must be text, json_object or json_schema, got {kind!r}")


def chat_body(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions body of a Responses body; `history`: the previous response's conversation."""
    messages = list(history) + _messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "expected a string")
        messages.insert(0, {"role": "system", "content": instructions})
    out = {"model": body.get("model"), "messages": messages, "stream": body.get("stream", False),
           "tools": _tools(body.get("tools")), "response_format": _format(body.get("text")),
           **{k: body[k] for k in ("temperature", "top_p", "tool_choice", "parallel_tool_calls", "seed")
              if body.get(k) is not None}}
    if body.get("max_output_tokens") is not None:
        out["max_completion_tokens"] = body["max_output_tokens"]
    return out


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclasses.dataclass
class ResponseBuilder:
    """One response: its object, the events of its stream, and the conversation to store.

    Feed it the handler's messages (`feed`, which returns the stream events they make); `finish`
    returns the last events (and completes the object)."""

    body: dict[str, Any]
    model: str
    id: str = dataclasses.field(default_factory=lambda: _id("resp"))
    created_at: int = dataclasses.field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    usage: dict[str, Any] | None = None
    status: str = "in_progress"
    incomplete: dict[str, str] | None = None
    seq: int = 0
    _text_item: dict[str, Any] | None = None  # the message item being streamed
    _calls: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)  # streamed function_call items

    def object(self) -> dict[str, Any]:
        b = self.body
        fmt = _format(b.get("text"))
        text_format: dict[str, Any] = {"type": "text"}
        if fmt is not None and fmt["type"] == "json_schema":
            text_format = {"type": "json_schema", "name": fmt["json_schema"].get("name") or "schema",
                           "schema": fmt["json_schema"]["schema"], "strict": True}
        elif fmt is not None:
            text_format = {"type": fmt["type"]}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": self.status,
                "model": self.model, "output": self.output, "usage": self.usage, "error": None,
                "incomplete_details": self.incomplete, "instructions": b.get("instructions"),
                "max_output_tokens": b.get("max_output_tokens"), "temperature": b.get("temperature", 1.0),
                "top_p": b.get("top_p", 1.0), "tools": b.get("tools") or [],
                "tool_choice": b.get("tool_choice") or "auto", "parallel_tool_calls": b.get("parallel_tool_calls", True),
                "previous_response_id": b.get("previous_response_id"), "store": b.get("store", True),
                "text": {"format": text_format}, "metadata": b.get("metadata") or {}, "truncation": "disabled",
                "reasoning": None, "user": b.get("user")}

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict[str, Any]]:
        obj = self.object()
        return [self._event("response.created", response=obj), self._event("response.in_progress", response=obj)]

    def _open_text(self) -> list[dict[str, Any]]:
        if self._text_item is not None:
            return []
        item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
        self._text_item = item
        self.output.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)),
                self._event("response.content_part.added", item_id=item["id"], output_index=len(self.output) - 1,
                            content_index=0, part=part)]

    def feed(self, m: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one handler message (streaming), and the object's state for it."""
        if "delta" in m and m["index"] == 0:
            events = self._open_text()
            item = self._text_item
            assert item is not None
            return [*events, self._event("response.output_text.delta", item_id=item["id"],
                                         output_index=self.output.index(item), content_index=0, delta=m["delta"],
                                         logprobs=[])]
        if "tool_calls" in m and "text" not in m and m["index"] == 0:
            return self._call_delta(m["tool_calls"][0])
        if "text" in m and m["index"] == 0:
            return self._final(m)
        if "usage" in m:
            u = m["usage"]
            self.usage = {"input_tokens": u["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
                          "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": u["prompt_tokens"] + u["completion_tokens"]}
        return []

    def _call_delta(self, d: dict[str, Any]) -> list[dict[str, Any]]:
        k = d["index"]
        if k not in self._calls:
            item = {"type": "function_call", "id": _id("fc"), "call_id": d["id"], "name": d["function"]["name"],
                    "arguments": "", "status": "in_progress"}
            self._calls[k] = item
            self.output.append(item)
            return [self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))]
        item = self._calls[k]
        item["arguments"] += d["function"]["arguments"]
        return [self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=self.output.index(item), delta=d["function"]["arguments"])]

    def _final(self, m: dict[str, Any]) -> list[dict[str, Any]]:
        """Choice 0 is done: its text item and its calls complete."""
        events = []
        if m["text"] or not m.get("tool_calls"):
            events += self._open_text()
            item = self._text_item
            assert item is not None
            i = self.output.index(item)
            part = {"type": "output_text", "text": m["text"], "annotations": [], "logprobs": []}
            item["content"], item["status"] = [part], "completed"
            events += [self._event("response.output_text.done", item_id=item["id"], output_index=i, content_index=0,
                                   text=m["text"], logprobs=[]),
                       self._event("response.content_part.done", item_id=item["id"], output_index=i,
                                   content_index=0, part=part),
                       self._event("response.output_item.done", output_index=i, item=item)]
        for k, call in enumerate(m.get("tool_calls") or []):
            if k not in self._calls:  # not streamed: the whole item now
                self._call_delta({"index": k, "id": call["id"], "function": {"name": call["function"]["name"]}})
            item = self._calls[k]
            item["arguments"], item["status"] = call["function"]["arguments"], "completed"
            i = self.output.index(item)
            events += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                   name=item["name"], arguments=item["arguments"]),
                       self._event("response.output_item.done", output_index=i, item=item)]
        for k in [k for k in self._calls if k >= len(m.get("tool_calls") or [])]:  # a call cut by max_output_tokens
            self.output.remove(self._calls.pop(k))
        if m["finish_reason"] == "length":
            self.incomplete = {"reason": "max_output_tokens"}
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The terminal event: `response.completed` (or `response.incomplete` at max_output_tokens)."""
        self.status = "incomplete" if self.incomplete else "completed"
        return [self._event(f"response.{self.status}", response=self.object())]

    def conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """`messages` (the request's, without its instructions) followed by this response's answer."""
        text = "".join(p["text"] for o in self.output if o["type"] == "message" for p in o["content"])
        calls = [{"id": o["call_id"], "type": "function", "function": {"name": o["name"], "arguments": o["arguments"]}}
                 for o in self.output if o["type"] == "function_call"]
        answer: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            answer["tool_calls"] = calls
        return [*messages, answer]
