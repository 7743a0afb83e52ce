"""uvicorn's h11 protocol with a deadline for a request's headers, which uvicorn does not have.

A client that opens a connection and sends a request line and headers slowly (or not at all)
holds a connection slot; uvicorn's keep-alive timeout covers only the idle time after a response.
Here a connection whose request has not started (its headers are not all in) within `timeout_s`
of its opening or of its last response is closed. The body is bounded in time by the route
(`host/server/openai_api.py`, `read_timeout_s` per piece); a WebSocket upgrade leaves this
protocol and is bounded by the authentication timeout.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["h11_with_header_timeout"]

log = logging.getLogger(__name__)


def h11_with_header_timeout(timeout_s: float) -> type[asyncio.Protocol]:
    """A uvicorn `http` protocol class: h11 with a `timeout_s` deadline for each request's headers."""

    class _HeaderTimeoutH11(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
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
