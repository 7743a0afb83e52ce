"""One client connection's state: authentication, the upload in progress, owned instances, outbox.

Every frame for a connection goes through its outbox, written by one task (`send_loop`), so
responses and instance events leave in the order they were queued: a launch's response always
precedes the instance's first event.
"""

from __future__ import annotations

import asyncio
import logging

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from host.server.programs import Upload

__all__ = ["Connection", "RequestError"]

log = logging.getLogger(__name__)

# A WebSocket close reason must fit in 123 UTF-8 bytes.
MAX_CLOSE_REASON_BYTES = 123


class RequestError(Exception):
    """A well-formed request that cannot be carried out; the message goes back to the client."""


class Connection:
    """A client connection; `send` and `close` queue, `send_loop` writes."""

    def __init__(self, ws: ServerConnection, authenticated: bool, max_queued: int) -> None:
        self.ws = ws
        self.max_queued = max_queued
        self.authenticated = authenticated
        self.tenant = "local"  # who this client is, once authenticated (see ServerConfig.tenants)
        self.auth_failures = 0
        self.upload: Upload | None = None
        self.instances: set[str] = set()
        self.closing = False
        # bytes = a frame to send; (code, reason) = close after what is queued; None = stop.
        self.outbox: asyncio.Queue[bytes | tuple[int, str] | None] = asyncio.Queue()

    def send(self, frame: bytes) -> None:
        """Queue one frame; a client that lets `max_queued` frames pile up is dropped."""
        if self.closing:
            return
        if self.outbox.qsize() >= self.max_queued:
            # The client stopped reading: a close frame would wait behind the backlog, so drop
            # the TCP connection; the reader then ends and the instances are released as usual.
            log.warning("connection %s: %d frames queued, client not reading; dropping it", self.ws.id,
                        self.outbox.qsize())
            self.closing = True
            self.ws.transport.abort()
            return
        self.outbox.put_nowait(frame)

    def close(self, code: int, reason: str) -> None:
        """Close with `code` and `reason` once the frames queued before are sent."""
        if not self.closing:
            self.closing = True
            reason = reason.encode()[:MAX_CLOSE_REASON_BYTES].decode(errors="ignore")
            self.outbox.put_nowait((code, reason))

    def stop(self) -> None:
        """End `send_loop` after what is queued."""
        self.outbox.put_nowait(None)

    async def send_loop(self) -> None:
        """Write queued frames in order until `stop`, a close, or the connection ends."""
        while True:
            item = await self.outbox.get()
            if item is None:
                return
            try:
                if isinstance(item, tuple):
                    await self.ws.close(*item)
                    return
                await self.ws.send(item)
            except ConnectionClosed:
                return
