"""HTTP plumbing with bounds: uvicorn's h11 protocol with a deadline for a request's headers (which
uvicorn does not have), a bounded body read, an SSE response with a write timeout.

A client that opens a connection and sends a request line and headers slowly (or not at all)
holds a connection slot; uvicorn's keep-alive timeout covers only the idle time after a response.
Here a connection whose request has not started (its headers are not all in) within `timeout_s`
of its opening or of its last response is closed. The body is bounded in time by the route
(`read_body`, a deadline per piece); a WebSocket upgrade leaves this protocol and is bounded by
the authentication timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import h11
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from host.server.openai_errors import OpenAIError

__all__ = ["h11_with_header_timeout", "GuardedStream", "read_body", "until_disconnect"]

log = logging.getLogger(__name__)


def h11_with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    """A uvicorn `http` protocol class: h11 with a `timeout_s` deadline for each request's headers."""

    class _HeaderTimeoutH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            # Nagle off. asyncio sets TCP_NODELAY only on sockets whose `proto` says TCP, and the listening
            # socket (socket.create_server) says 0, as do the ones it accepts. With Nagle on, a response's
            # body (uvicorn writes headers, then body) waited for the client's delayed ACK of the headers:
            # ~40 ms on every request of a kept-alive connection after its first (GET /v1/models 44 ms).
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:  # a request line and headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._deadline = self.loop.call_later(timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self) -> None:
            self._deadline = None
            busy = self.cycle is not None and not self.cycle.response_complete
            if busy or self.transport.is_closing() or self.transport.get_protocol() is not self:
                return  # a request is being answered, or the connection became a WebSocket
            log.info("closing HTTP connection from %s: no request headers within %g s", self.client, timeout_s)
            self.transport.close()

    return _HeaderTimeoutH11


class GuardedStream(StreamingResponse):
    """An SSE response that drops a client which takes longer than `write_timeout_s` to take one
    event (its instance is terminated as for a disconnect) and calls `on_close` when it ends,
    however it ends. Starlette ends the stream when the client disconnects (uvicorn's h11 speaks
    ASGI 2.3, so `StreamingResponse` listens for the disconnect while it streams)."""

    def __init__(self, body: AsyncIterator[bytes], write_timeout_s: float, on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._body = body
        self._write_timeout_s = write_timeout_s
        self._on_close = on_close

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self._body:
            try:
                await asyncio.wait_for(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                       self._write_timeout_s)
            except TimeoutError:
                log.warning("SSE client took more than %.1f s to take an event; dropping it", self._write_timeout_s)
                self._on_close()  # terminates the instance now
                return  # uvicorn closes a connection whose response did not complete
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The request body, at most `max_bytes` (413, told before reading when Content-Length says
    more), each piece within `timeout_s` (408)."""
    too_large = OpenAIError(413, f"the request body is larger than this server's limit of {max_bytes} "
                            "bytes (--max-body-mb)", code="request_too_large")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit() or len(length) > 20:
            raise OpenAIError(400, f"invalid Content-Length header {length[:40]!r}")
        if int(length) > max_bytes:
            raise too_large
    body = bytearray()
    pieces = request.stream().__aiter__()
    while True:
        try:
            piece = await asyncio.wait_for(pieces.__anext__(), timeout_s)
        except StopAsyncIteration:
            return bytes(body)
        except TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within {timeout_s:g} s "
                              "(--read-timeout-s)", code="request_timeout") from None
        body += piece
        if len(body) > max_bytes:
            raise too_large


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (after its body was read, only a disconnect comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass
