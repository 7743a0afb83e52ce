"""The messages and tools of a chat request, validated: roles, text and image content parts,
assistant tool calls, tool messages (`parse_messages`); function tools, `tool_choice` and
`parallel_tool_calls` (`parse_tools`). Errors are 400s naming `messages`, `tools` or `tool_choice`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from host.server.openai_errors import bad_param as _bad

__all__ = ["parse_messages", "parse_tools"]

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


def parse_messages(value: Any) -> tuple[dict[str, Any], ...]:
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


def parse_tools(body: dict[str, Any]) -> tuple[tuple[dict[str, Any], ...] | None, str | dict[str, Any], bool]:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a body."""
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"expected a boolean, got {parallel!r}")
    return tools, _tool_choice(body.get("tool_choice"), tools), parallel
