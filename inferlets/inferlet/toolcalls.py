"""Tool calls for chat handlers (OpenAI's `tools`, issue 39): how tools and past calls reach the model,
the grammars a call is drawn under, and the parsing of the model's own call format.

Pure functions over JSON-shaped dicts (no host call), so that a handler (inferlets/openai_chat) picks
its policy from them and the server can count a prompt the way the handler fills it.

The call format is Hermes' (Qwen2.5 / Qwen3 templates): `<tool_call>\\n{"name": ..., "arguments": {...}}
\\n</tool_call>`. A template that reads `tools` renders the tools and past calls itself (as
transformers' `apply_chat_template(messages, tools=...)`); for one that does not, `chat_messages`
writes them in the same format: the tools into the system message, the calls into the assistant's
content, the tool results as user turns in `<tool_response>` tags.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

__all__ = ["CALL_OPEN", "CallStream", "ToolCall", "auto_grammar", "calls_schema", "chat_messages", "make_call_id",
           "parse_calls", "plain_chat", "render_chat", "template_reads_tools"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
MAX_FORCED_CALLS = 8  # calls one forced answer may hold (a small model could otherwise list calls until max_tokens)
# JSON written as json.dumps writes it (the host's json_schema options), unknown `format`s ignored.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_CALL_HEAD = re.compile(r'\s*(?:\[|, )\{"name": ("(?:[^"\\]|\\.)*"), "arguments": ')

_SYSTEM_TOOLS = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

ToolCall = dict[str, Any]  # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments": str}}
Render = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]


def plain_chat(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """Whether a chat needs none of this: no tools to show, no call or tool result in it (the plain
    role/content rendering, `Context.fill_chat`, is the same text)."""
    return not tools and all(m["role"] != "tool" and not m.get("tool_calls") for m in messages)


def template_reads_tools(template: str) -> bool:
    """Whether a chat template renders `tools` itself (it names the variable)."""
    return re.search(r"\btools\b", template) is not None


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments(call: dict[str, Any]) -> Any:
    """A past call's arguments as the templates read them: an object (OpenAI sends a JSON string)."""
    args = call.get("function", {}).get("arguments", "{}")
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args


def _call_text(call: dict[str, Any]) -> str:
    fn = call.get("function", {})
    return f"{CALL_OPEN}\n{json.dumps({'name': fn.get('name'), 'arguments': _arguments(call)})}\n{CALL_CLOSE}"


def chat_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  native: bool) -> list[dict[str, Any]]:
    """The messages to render. `native`: for a template that reads `tools` (arguments as objects,
    content never null); otherwise every message as plain role/content text in the Hermes format."""
    if native:
        out = []
        for m in messages:
            m = {**m, "content": m.get("content") or ""}
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c)}}
                                   for c in m["tool_calls"]]
            out.append(m)
        return out
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        elif m.get("tool_calls"):
            content = "\n".join([content] * bool(content) + [_call_text(c) for c in m["tool_calls"]])
        if out and role == "user" and m["role"] == "tool" and out[-1].get("tool_turn"):
            out[-1]["content"] += "\n" + content  # consecutive results: one user turn, as Qwen's template does
            continue
        out.append({"role": role, "content": content, **({"tool_turn": True} if m["role"] == "tool" else {})})
    for m in out:
        m.pop("tool_turn", None)
    if tools:
        text = _SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{text}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_chat(render: Render, template: str, messages: list[dict[str, Any]],
                tools: list[dict[str, Any]] | None) -> tuple[str, bool]:
    """The prompt text and whether the template rendered the tools itself (`native`). A template that
    reads `tools` but fails on them (or on the calls) gets the Hermes text instead."""
    if template_reads_tools(template):
        try:
            return render(chat_messages(messages, tools, True), tools), True
        except ValueError:
            pass
    return render(chat_messages(messages, tools, False), None), False


def _one_call(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """JSON schema of one call to one of `tools`: {"name": its name, "arguments": its parameters}."""
    variants = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                  "arguments": t["function"].get("parameters") or {"type": "object"}},
                 "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """JSON schema of a forced answer (`tool_choice` required or a named function): an array of calls,
    one (`parallel` false) or up to MAX_FORCED_CALLS."""
    return {"type": "array", "items": _one_call(tools), "minItems": 1,
            "maxItems": MAX_FORCED_CALLS if parallel else 1}


def auto_grammar(tools: list[dict[str, Any]], parallel: bool) -> str:
    """Lark grammar of an `auto` answer for a template with no call format of its own: either text
    (which cannot begin with "<") or Hermes calls whose arguments follow the tools' schemas."""
    schema = {**_one_call(tools), "x-guidance": _JSON_OPTIONS}
    calls = "call+" if parallel else "call"
    return (f"start: TEXT | {calls}\n"
            f'call: "{CALL_OPEN}\\n" %json {json.dumps(schema)} "\\n{CALL_CLOSE}" "\\n"?\n'
            "TEXT: /[^<][\\s\\S]*/\n")


def _to_call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": make_call_id(), "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[ToolCall]]:
    """The model's Hermes calls in `text` (to tools it has) and the text around them (with calls, its
    trailing whitespace dropped). A block that does not parse, or names no tool, stays in the text."""
    names = {t["function"]["name"] for t in tools}
    calls: list[ToolCall] = []

    def take(m: re.Match[str]) -> str:
        try:
            call = _to_call(json.loads(m.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            return m.group(0)
        calls.append(call)
        return ""

    rest = _BLOCK.sub(take, text)
    return (rest.rstrip() if calls else rest), calls


class CallStream:
    """Follows a forced answer (`calls_schema`'s array, written as json.dumps writes it, each call's
    "name" before its "arguments": the grammar's order) as it grows: `feed` returns OpenAI's streamed
    call deltas, a call's id and name once its name is complete, then its arguments as they come.
    `calls` are the calls completed so far, their arguments the generated text itself (what the
    fragments add up to)."""

    def __init__(self) -> None:
        self.text, self.pos = "", 0  # the answer so far; where the next call's head is expected
        self.calls: list[ToolCall] = []
        self._args_at: int | None = None  # where the open call's arguments begin
        self._sent = 0  # of the open call's arguments, characters sent

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        out: list[dict[str, Any]] = []
        while True:
            if self._args_at is None:
                head = _CALL_HEAD.match(self.text, self.pos)
                if head is None:
                    return out
                self._args_at, self._sent = head.end(), 0
                call = {"id": make_call_id(), "type": "function",
                        "function": {"name": json.loads(head.group(1)), "arguments": ""}}
                self.calls.append(call)
                out.append({"index": len(self.calls) - 1, "id": call["id"], "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""}})
            end = _value_end(self.text, self._args_at)
            upto = len(self.text) if end is None else end
            call = self.calls[-1]
            if upto > self._args_at + self._sent:
                fragment = self.text[self._args_at + self._sent : upto]
                call["function"]["arguments"] += fragment
                self._sent += len(fragment)
                out.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
            if end is None:
                return out
            self.pos, self._args_at = end + 1, None  # past the call's closing "}"

    def complete(self) -> list[ToolCall]:
        """The calls whose arguments are complete (a cut answer's last one may not be)."""
        return self.calls if self._args_at is None else self.calls[:-1]


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array starting at `start` ends (one past its close), None if not yet."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
