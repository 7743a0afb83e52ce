"""Test support: an MCP server (the official `mcp` package, streamable HTTP) on loopback.

    with serve_mcp() as url:          # http://127.0.0.1:PORT/mcp
        ...

Tools: `add(a, b)`, `echo(text)`, `fail(message)` (always fails: the result has isError true) and
`weather(city)` (a fixed answer). The server runs under uvicorn in a background thread, with stateful
sessions (`Mcp-Session-Id`); `json_response=True` answers with one JSON body instead of an SSE stream.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

__all__ = ["TOOL_NAMES", "build_server", "serve_mcp"]

TOOL_NAMES = ("add", "echo", "fail", "weather")


def build_server() -> MCPServer:
    """The MCP server with the four test tools."""
    server = MCPServer("pie-test-mcp", version="1.0.0", log_level="WARNING")

    @server.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    @server.tool()
    def fail(message: str) -> str:
        """Always fail with the given message."""
        raise ToolError(message)

    @server.tool()
    def weather(city: str) -> str:
        """The current weather in a city (a fixed answer)."""
        return f"{city}: 21C, sunny"

    return server


@contextmanager
def serve_mcp(json_response: bool = False, stateless: bool = False) -> Iterator[str]:
    """Serve the test MCP server on 127.0.0.1 (a free port) and yield its endpoint URL."""
    app = build_server().streamable_http_app(json_response=json_response, stateless_http=stateless)
    # proto given explicitly: asyncio sets TCP_NODELAY on accepted connections only when the listening
    # socket's proto is IPPROTO_TCP (0 otherwise), and without it each response after the first on a
    # kept-alive connection waits ~40 ms (Nagle against the client's delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name=f"mcp-server-{port}",
                              daemon=True)
    logging.getLogger("mcp").setLevel(logging.WARNING)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
        sock.close()
