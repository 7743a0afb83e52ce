"""A Model Context Protocol (MCP) client over the streamable HTTP transport, for inferlets.

    from inferlet.mcp import McpClient

    def main(args):
        with McpClient("https://tools.example.com/mcp", headers={"Authorization": "Bearer ..."}) as mcp:
            tools = mcp.list_tools()                      # [Tool(name, description, input_schema), ...]
            return mcp.call_tool_text("weather", {"city": "Paris"})

Synchronous and pure Python: every message is one HTTP POST sent through `fetch` (by default
`inferlet.http.fetch`, so the operator must allow the server's host: `pie-serve --http-allow HOST`).
It speaks protocol revision 2025-06-18 and accepts a server that negotiates 2025-03-26. A response may be
one JSON body or a server-sent-event stream, read whole; server notifications and requests in a stream
are skipped. JSON-RPC errors, HTTP statuses other than 2xx and protocol violations raise `McpError`;
what `fetch` itself raises (`inferlet.http.HttpError`: blocked, timeout, ...) passes through unchanged.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["McpClient", "McpError", "PROTOCOL_VERSION", "SUPPORTED_VERSIONS", "SseEvent", "Tool", "parse_sse"]

PROTOCOL_VERSION = "2025-06-18"
SUPPORTED_VERSIONS = ("2025-06-18", "2025-03-26")

_JSON_TYPE = "application/json"
_SSE_TYPE = "text/event-stream"
_OWN_HEADERS = frozenset({"content-type", "accept", "mcp-session-id", "mcp-protocol-version"})
_MAX_PAGES = 1000  # tools/list pages followed before giving up on a server that never stops


class McpError(Exception):
    """An MCP call failed: a JSON-RPC error (`code`, `data`), an HTTP status other than 2xx (`status`)
    or a reply that breaks the protocol (both None)."""

    def __init__(self, message: str, *, code: int | None = None, status: int | None = None,
                 data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.status = status
        self.data = data


@dataclass(frozen=True)
class Tool:
    """A tool the server offers (`tools/list`)."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Any) -> Tool:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise McpError(f"tools/list: a tool without a name: {obj!r:.200}")
        schema = obj.get("inputSchema")
        return cls(obj["name"], obj.get("description") or "", schema if isinstance(schema, dict) else {})

    def openai(self) -> dict[str, Any]:
        """The tool in OpenAI's `tools` shape ({"type": "function", "function": {...}})."""
        params = self.input_schema or {"type": "object", "properties": {}}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": params}}


@dataclass(frozen=True)
class SseEvent:
    """One server-sent event: its type ("message" unless named), data lines joined by "\\n", and id."""

    event: str = "message"
    data: str = ""
    id: str | None = None


def parse_sse(text: str) -> list[SseEvent]:
    """The events of a whole `text/event-stream` body (the WHATWG rules: comments and unknown fields
    skipped, one leading space stripped from a value, an event without data dropped). An event left
    unterminated at the end of the body still counts."""
    events: list[SseEvent] = []
    event, last_id = "", None
    data: list[str] = []
    for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n") + [""]:
        if not line:
            if data:
                events.append(SseEvent(event or "message", "\n".join(data), last_id))
            event, data = "", []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "data":
            data.append(value)
        elif name == "event":
            event = value
        elif name == "id" and "\0" not in value:
            last_id = value
    return events


def _content_type(resp: Any) -> str:
    return (resp.header("content-type") or "").split(";", 1)[0].strip().lower()


class McpClient:
    """An MCP client session with one server endpoint (streamable HTTP). `headers` go with every
    request (e.g. Authorization); `fetch` has the signature of `inferlet.http.fetch`."""

    def __init__(self, url: str, headers: Mapping[str, str] | None = None,
                 fetch: Callable[..., Any] | None = None, timeout_ms: int | None = 30000,
                 client_name: str = "inferlet", client_version: str = "0.1.0") -> None:
        self.url = url
        self.headers = dict(headers or {})
        self.timeout_ms = timeout_ms
        self.client_name = client_name
        self.client_version = client_version
        self._fetch = fetch
        self._next_id = 1
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self.server_result: dict[str, Any] | None = None

    # -- the session ----------------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self.server_result is not None

    @property
    def server_info(self) -> dict[str, Any]:
        return (self.server_result or {}).get("serverInfo") or {}

    @property
    def server_capabilities(self) -> dict[str, Any]:
        return (self.server_result or {}).get("capabilities") or {}

    def initialize(self) -> dict[str, Any]:
        """Open the session (`initialize`, then `notifications/initialized`) unless it is open; the
        server's result (protocolVersion, serverInfo, capabilities, ...)."""
        if self.server_result is not None:
            return self.server_result
        self.session_id = self.protocol_version = None
        params = {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                  "clientInfo": {"name": self.client_name, "version": self.client_version}}
        result, resp = self._exchange("initialize", params)
        self.session_id = resp.header("mcp-session-id") or None
        version = result.get("protocolVersion")
        if version not in SUPPORTED_VERSIONS:
            self.close()
            raise McpError(f"initialize: the server speaks protocol version {version!r}, "
                           f"this client {' or '.join(SUPPORTED_VERSIONS)}")
        self.protocol_version = version
        self._notify("notifications/initialized")
        self.server_result = result
        return result

    def close(self) -> None:
        """End the session: DELETE it on the server when it has an id (a refusal, e.g. 405, or a failure
        is ignored). A later call opens a new session."""
        if self.session_id is not None:
            with contextlib.suppress(Exception):
                self._send("DELETE", None)
        self.session_id = self.protocol_version = self.server_result = None

    def __enter__(self) -> McpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- tools ----------------------------------------------------------------------------------------

    def list_tools(self) -> list[Tool]:
        """Every tool the server offers (all pages of `tools/list`)."""
        tools: list[Tool] = []
        cursor: str | None = None
        seen: set[str] = set()
        for _ in range(_MAX_PAGES):
            result = self.request("tools/list", {"cursor": cursor} if cursor is not None else None)
            listed = result.get("tools")
            if not isinstance(listed, list):
                raise McpError(f"tools/list: no tools list in the result: {result!r:.200}")
            tools.extend(Tool.from_json(t) for t in listed)
            cursor = result.get("nextCursor")
            if cursor is None:
                return tools
            if not isinstance(cursor, str) or cursor in seen:
                raise McpError(f"tools/list: a bad or repeated nextCursor {cursor!r:.100}")
            seen.add(cursor)
        raise McpError(f"tools/list: more than {_MAX_PAGES} pages")

    def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """Call a tool; the raw result ({"content": [...], "isError": ..., "structuredContent": ...}).
        A tool that failed is a result with isError true, not an exception."""
        return self.request("tools/call", {"name": name, "arguments": arguments or {}})

    def call_tool_text(self, name: str, arguments: dict[str, Any] | None = None) -> str:
        """Call a tool and return the text parts of its content joined by "\\n" (its structuredContent
        as JSON when it has no text). Raises McpError, with the text, when the tool failed."""
        result = self.call_tool(name, arguments)
        content = result.get("content")
        parts = content if isinstance(content, list) else []
        text = "\n".join(p["text"] for p in parts if isinstance(p, dict) and p.get("type") == "text"
                         and isinstance(p.get("text"), str))
        if result.get("isError"):
            raise McpError(f"tool {name!r} failed: {text or 'no message'}", data=result)
        if not text and result.get("structuredContent") is not None:
            return json.dumps(result["structuredContent"])
        return text

    # -- JSON-RPC over HTTP ---------------------------------------------------------------------------

    def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send any JSON-RPC request in the session (opened first if need be); its result. A session
        the server has forgotten (404 to a request that carried its id) is opened again once."""
        self.initialize()
        try:
            return self._exchange(method, params)[0]
        except McpError as e:
            if e.status != 404 or self.session_id is None:
                raise
        self.server_result = None
        self.initialize()
        return self._exchange(method, params)[0]

    def _exchange(self, method: str, params: dict[str, Any] | None) -> tuple[dict[str, Any], Any]:
        rid = self._next_id
        self._next_id += 1
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            message["params"] = params
        resp = self._send("POST", message)
        self._check_status(method, resp)
        reply = self._find_reply(method, rid, resp)
        if "error" in reply:
            err = reply["error"] if isinstance(reply["error"], dict) else {}
            code = err.get("code")
            raise McpError(f"{method}: JSON-RPC error {code}: {err.get('message', '')}",
                           code=code if isinstance(code, int) else None, data=err.get("data"))
        result = reply.get("result")
        if not isinstance(result, dict):
            raise McpError(f"{method}: the result is not an object: {result!r:.200}")
        return result, resp

    def _notify(self, method: str, params: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            message["params"] = params
        self._check_status(method, self._send("POST", message))

    def _send(self, http_method: str, message: dict[str, Any] | None) -> Any:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _OWN_HEADERS}
        headers["Accept"] = f"{_JSON_TYPE}, {_SSE_TYPE}"
        if message is not None:
            headers["Content-Type"] = _JSON_TYPE
        if self.session_id is not None:
            headers["Mcp-Session-Id"] = self.session_id
        if self.protocol_version is not None:
            headers["MCP-Protocol-Version"] = self.protocol_version
        fetch = self._fetch
        if fetch is None:
            from inferlet import http  # at call time: the host import only exists inside an inferlet

            fetch = http.fetch
        body = json.dumps(message) if message is not None else None
        return fetch(self.url, http_method, headers, body, self.timeout_ms)

    def _check_status(self, method: str, resp: Any) -> None:
        if 200 <= resp.status < 300:
            return
        detail = resp.body.decode("utf-8", "replace").strip()
        try:
            err = json.loads(detail).get("error") or {}
            detail = str(err.get("message") or detail)
        except (ValueError, AttributeError):
            pass
        tail = f": {detail[:300]}" if detail else ""
        raise McpError(f"{method}: HTTP {resp.status} from {self.url}{tail}", status=resp.status)

    def _find_reply(self, method: str, rid: int, resp: Any) -> dict[str, Any]:
        kind = _content_type(resp)
        text = resp.body.decode("utf-8", "replace")
        messages: list[Any]
        if kind == _SSE_TYPE:
            messages = []
            for ev in parse_sse(text):
                if ev.event != "message":
                    continue
                try:
                    messages.append(json.loads(ev.data))
                except ValueError:
                    raise McpError(f"{method}: an event that is not JSON: {ev.data[:200]!r}") from None
        elif kind == _JSON_TYPE:
            try:
                body = json.loads(text)
            except ValueError:
                raise McpError(f"{method}: a response that is not JSON: {text[:200]!r}") from None
            messages = body if isinstance(body, list) else [body]
        elif resp.status == 202 or not resp.body:
            raise McpError(f"{method}: HTTP {resp.status} with no response to the request")
        else:
            raise McpError(f"{method}: unexpected Content-Type {kind or 'none'!r} (HTTP {resp.status})")
        for msg in messages:  # a batch, or a stream with notifications and requests from the server
            if (isinstance(msg, dict) and type(msg.get("id")) is int and msg["id"] == rid
                    and ("result" in msg or "error" in msg)):
                return msg
        for msg in messages:  # an error the server could not tie to a request (id null: e.g. a parse error)
            if isinstance(msg, dict) and msg.get("id", 0) is None and "error" in msg:
                return msg
        raise McpError(f"{method}: the server's reply holds no response with id {rid}")
