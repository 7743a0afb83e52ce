"""inferlet.mcp: the SDK's MCP client (streamable HTTP) on plain CPython, against a server built with the
official `mcp` package (tests/mcp_server.py), its requests sent through an httpx-backed `fetch`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import inferlet.http
import pytest
from inferlet.http import Response
from inferlet.mcp import PROTOCOL_VERSION, McpClient, McpError, SseEvent, Tool, parse_sse
from mcp_server import TOOL_NAMES, serve_mcp


@dataclass
class Sent:
    method: str
    url: str
    headers: dict[str, str]
    body: Any


@dataclass
class HttpxFetch:
    """`inferlet.http.fetch`'s signature over httpx; records what it sent (header names lowercased)."""

    client: httpx.Client
    sent: list[Sent] = field(default_factory=list)

    def __call__(self, url: str, method: str = "GET", headers: Any = None, body: bytes | str | None = None,
                 timeout_ms: int | None = None) -> Response:
        pairs = list(headers.items()) if isinstance(headers, dict) else list(headers or ())
        data = body.encode() if isinstance(body, str) else (body or b"")
        lowered = {k.lower(): v for k, v in pairs}
        self.sent.append(Sent(method, url, lowered, json.loads(data) if data else None))
        r = self.client.request(method, url, headers=pairs, content=data,
                                timeout=None if timeout_ms is None else timeout_ms / 1000)
        return Response(status=r.status_code, headers=list(r.headers.items()), body=r.content)


@pytest.fixture(scope="module", params=[False, True], ids=["sse", "json"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    with serve_mcp(json_response=request.param) as u:
        yield u


@pytest.fixture(scope="module")
def http_client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=10) as c:  # one for the module: building one (its TLS context) takes ~30 ms
        yield c


@pytest.fixture
def fetch(http_client: httpx.Client) -> HttpxFetch:
    return HttpxFetch(http_client)


@pytest.fixture
def client(url: str, fetch: HttpxFetch) -> Iterator[McpClient]:
    with McpClient(url, fetch=fetch) as c:
        yield c


def test_initialize_returns_the_server_info_and_opens_a_session(client: McpClient, fetch: HttpxFetch) -> None:
    result = client.initialize()
    assert result["serverInfo"]["name"] == "pie-test-mcp" and result["protocolVersion"] == PROTOCOL_VERSION
    assert "tools" in result["capabilities"] and client.server_info["version"] == "1.0.0"
    assert client.session_id and client.protocol_version == PROTOCOL_VERSION
    init, note = fetch.sent
    assert init.body["method"] == "initialize" and init.body["id"] == 1
    assert init.body["params"]["clientInfo"] == {"name": "inferlet", "version": "0.1.0"}
    assert "mcp-session-id" not in init.headers and "mcp-protocol-version" not in init.headers
    assert note.body == {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert client.initialize() is result and len(fetch.sent) == 2  # once per session


def test_list_tools_gives_the_four_tools_with_their_schemas(client: McpClient) -> None:
    tools = {t.name: t for t in client.list_tools()}
    assert sorted(tools) == sorted(TOOL_NAMES)
    add = tools["add"]
    assert add.description == "Add two integers."
    assert add.input_schema["properties"]["a"]["type"] == "integer"
    assert sorted(add.input_schema["required"]) == ["a", "b"]
    assert tools["weather"].input_schema["required"] == ["city"]
    assert add.openai()["function"]["parameters"] is add.input_schema


def test_call_tool_returns_the_raw_result(client: McpClient) -> None:
    result = client.call_tool("add", {"a": 2, "b": 3})
    assert result["content"] == [{"type": "text", "text": "5"}] and not result["isError"]
    assert result["structuredContent"] == {"result": 5}
    assert client.call_tool_text("echo", {"text": "two\nlines"}) == "two\nlines"


def test_call_tool_text(client: McpClient) -> None:
    assert client.call_tool_text("weather", {"city": "Paris"}) == "Paris: 21C, sunny"


def test_a_failing_tool_raises_with_its_message(client: McpClient) -> None:
    with pytest.raises(McpError, match="boom") as e:
        client.call_tool_text("fail", {"message": "boom"})
    assert e.value.data["isError"] is True
    assert client.call_tool("fail", {"message": "boom"})["isError"] is True  # the raw result does not raise


def test_an_unknown_tool_is_an_error(client: McpClient) -> None:
    with pytest.raises(McpError, match="nope"):
        client.call_tool_text("nope", {})


def test_a_json_rpc_error_carries_its_code(client: McpClient) -> None:
    with pytest.raises(McpError, match="JSON-RPC error -32601") as e:
        client.request("no/such/method")
    assert e.value.code == -32601 and e.value.status is None


def test_every_request_carries_the_session_and_the_transport_headers(client: McpClient,
                                                                     fetch: HttpxFetch) -> None:
    client.list_tools()
    client.call_tool("add", {"a": 1, "b": 1})
    assert [s.body.get("id") for s in fetch.sent] == [1, None, 2, 3]
    for s in fetch.sent:
        assert s.method == "POST" and s.headers["content-type"] == "application/json"
        assert s.headers["accept"] == "application/json, text/event-stream"
    for s in fetch.sent[1:]:
        assert s.headers["mcp-session-id"] == client.session_id
        assert s.headers["mcp-protocol-version"] == PROTOCOL_VERSION


def test_close_deletes_the_session_and_a_later_call_opens_another(url: str, fetch: HttpxFetch) -> None:
    client = McpClient(url, fetch=fetch, headers={"X-Api-Key": "k", "accept": "text/html"})
    client.initialize()
    old = client.session_id
    client.close()
    assert fetch.sent[-1].method == "DELETE" and fetch.sent[-1].headers["mcp-session-id"] == old
    assert client.session_id is None and not client.initialized
    accept = "application/json, text/event-stream"
    gone = fetch.client.post(url, headers={"Mcp-Session-Id": old, "Accept": accept},
                             json={"jsonrpc": "2.0", "id": 9, "method": "tools/list"})
    assert gone.status_code == 404
    assert client.call_tool_text("add", {"a": 1, "b": 2}) == "3"
    assert client.session_id not in (None, old)
    assert all(s.headers["x-api-key"] == "k" and s.headers["accept"] != "text/html" for s in fetch.sent)
    client.close()


def test_a_session_the_server_forgot_is_opened_again(client: McpClient, fetch: HttpxFetch) -> None:
    client.initialize()
    old = client.session_id
    fetch.client.delete(client.url, headers={"Mcp-Session-Id": old})  # the server ends it
    assert client.call_tool_text("weather", {"city": "Oslo"}) == "Oslo: 21C, sunny"
    assert client.session_id != old


def test_a_url_that_is_not_mcp_names_the_status(url: str, fetch: HttpxFetch) -> None:
    with pytest.raises(McpError, match="initialize: HTTP 404") as e:
        McpClient(url + "/nope", fetch=fetch).list_tools()
    assert e.value.status == 404


def test_the_default_fetch_is_inferlet_http_fetch(url: str, fetch: HttpxFetch,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inferlet.http, "fetch", fetch)
    with McpClient(url, timeout_ms=5000) as client:
        assert client.call_tool_text("add", {"a": 20, "b": 22}) == "42"
    assert fetch.sent and fetch.sent[-1].method == "DELETE"


def test_a_stateless_server_has_no_session(fetch: HttpxFetch) -> None:
    with serve_mcp(stateless=True) as url, McpClient(url, fetch=fetch) as client:
        assert client.call_tool_text("echo", {"text": "hi"}) == "hi"
        assert client.session_id is None


# -- without a server ---------------------------------------------------------------------------------


def test_parse_sse() -> None:
    stream = (": keep-alive comment\r\n\r\n"
              "event: message\r\n"
              'data: {"jsonrpc":"2.0","method":"notifications/message","params":{"level":"info"}}\r\n\r\n'
              "id: 7\n"
              "retry: 1000\n"
              'data: {"jsonrpc": "2.0", "id": 3,\n'
              'data:  "result": {"content": []}}\n'
              "\n"
              "event: ping\ndata\n\n"
              "id: 8\n\n"  # no data: no event
              "data: last, unterminated")
    events = parse_sse(stream)
    assert [e.event for e in events] == ["message", "message", "ping", "message"]
    assert json.loads(events[0].data)["method"] == "notifications/message"
    assert events[1] == SseEvent("message", '{"jsonrpc": "2.0", "id": 3,\n "result": {"content": []}}', "7")
    assert json.loads(events[1].data)["id"] == 3
    assert events[2].data == ""  # a bare "data" field is an empty line of data
    assert events[3].data == "last, unterminated" and events[3].id == "8"


class Scripted:
    """A fetch that answers each JSON-RPC request with `answer(message) -> Response`."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.sent: list[dict[str, Any]] = []

    def __call__(self, url: str, method: str = "GET", headers: Any = None, body: Any = None,
                 timeout_ms: int | None = None) -> Response:
        msg = json.loads(body) if body else {}
        self.sent.append(msg)
        if "id" not in msg:
            return Response(202)
        return self.answer(msg)


def _json(obj: Any, status: int = 200, **headers: str) -> Response:
    pairs = [("Content-Type", "application/json"), *headers.items()]
    return Response(status, pairs, json.dumps(obj).encode())


def _sse(*objs: Any) -> Response:
    body = "".join(f"event: message\ndata: {json.dumps(o)}\n\n" for o in objs)
    return Response(200, [("Content-Type", "text/event-stream; charset=utf-8")], body.encode())


def _init_result(version: str = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"protocolVersion": version, "capabilities": {"tools": {}},
            "serverInfo": {"name": "s", "version": "1"}}


def test_a_stream_with_server_messages_before_the_response() -> None:
    def answer(msg: dict[str, Any]) -> Response:
        if msg["method"] == "initialize":
            return _json({"jsonrpc": "2.0", "id": msg["id"], "result": _init_result("2025-03-26")})
        content = [{"type": "text", "text": "a"}, {"type": "image", "data": ""}, {"type": "text", "text": "b"}]
        return _sse({"jsonrpc": "2.0", "method": "notifications/progress", "params": {"progress": 1}},
                    {"jsonrpc": "2.0", "id": 99, "method": "ping"},  # a request from the server: skipped
                    {"jsonrpc": "2.0", "id": msg["id"], "result": {"content": content}})

    client = McpClient("http://mcp.test/mcp", fetch=Scripted(answer))
    assert client.call_tool_text("t") == "a\nb"
    assert client.protocol_version == "2025-03-26" and client.session_id is None


def test_list_tools_follows_the_cursor() -> None:
    pages = {None: ([{"name": "a", "inputSchema": {"type": "object"}}], "p2"), "p2": ([{"name": "b"}], None)}

    def answer(msg: dict[str, Any]) -> Response:
        if msg["method"] == "initialize":
            return _json({"jsonrpc": "2.0", "id": msg["id"], "result": _init_result()})
        tools, cursor = pages[(msg.get("params") or {}).get("cursor")]
        result: dict[str, Any] = {"tools": tools} | ({"nextCursor": cursor} if cursor else {})
        return _json([{"jsonrpc": "2.0", "id": msg["id"], "result": result}])  # a batch of one

    fetch = Scripted(answer)
    assert McpClient("http://mcp.test/mcp", fetch=fetch).list_tools() == [
        Tool("a", "", {"type": "object"}), Tool("b", "", {})]
    assert [m.get("id") for m in fetch.sent] == [1, None, 2, 3]


@pytest.mark.parametrize(("reply", "match"), [
    (_json({"jsonrpc": "2.0", "id": 1, "result": _init_result("1999-01-01")}),
     "protocol version '1999-01-01'"),
    (Response(200, [("Content-Type", "text/html")], b"<html>"), "unexpected Content-Type 'text/html'"),
    (Response(202), "HTTP 202 with no response"),
    (_json({"jsonrpc": "2.0", "id": 5, "result": {}}), "no response with id 1"),
    (_json({"jsonrpc": "2.0", "id": None, "error": {"code": -32700, "message": "Parse error"}}),
     "JSON-RPC error -32700: Parse error"),
    (_json({"jsonrpc": "2.0", "id": None, "error": {"code": -32600, "message": "Bad session"}}, 400),
     "HTTP 400 from http://mcp.test/mcp: Bad session"),
    (Response(500, [], b"upstream down"), "HTTP 500 from http://mcp.test/mcp: upstream down"),
])
def test_protocol_violations_raise(reply: Response, match: str) -> None:
    with pytest.raises(McpError, match=match):
        McpClient("http://mcp.test/mcp", fetch=Scripted(lambda msg: reply)).initialize()
