"""One client connection's state: authentication, the upload in progress, owned instances, outbox.

Every frame for a connection goes through its outbox, written by one task (`send_loop`), so
responses and instance events leave in the order they were queued: a launch's response always
precedes the instance's first event. The socket is a Starlette `WebSocket` (ASGI, served by
uvicorn); the frames on the wire are the same binary msgpack frames as always (docs/protocol.md).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketDisconnected

from host.server.config import LOCAL_TENANT
from host.server.programs import Upload

__all__ = ["Connection", "RequestError"]

log = logging.getLogger(__name__)

# A WebSocket close reason must fit in 123 UTF-8 bytes.
MAX_CLOSE_REASON_BYTES = 123


class RequestError(Exception):
    """A well-formed request that cannot be carried out; the message goes back to the client."""


class Connection:
    """A client connection; `send` and `close` queue, `send_loop` writes.

    `on_drop` is called (on the event loop) when the client stops reading and is dropped: the
    server then ends the connection without waiting for its socket to drain. Invariant:
    `queued_bytes` is the size of the frames queued and not yet written, at most `max_queued_bytes`.
    """

    def __init__(self, ws: WebSocket, authenticated: bool, max_queued: int,
                 on_drop: Callable[[], None] | None = None, max_queued_bytes: int = 16 * 2**20,
                 admin: bool = False) -> None:
        self.ws = ws
        self.id = uuid.uuid4().hex[:12]
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.authenticated = authenticated
        self.tenant = LOCAL_TENANT  # who this client is, once authenticated (see ServerConfig.tenants)
        self.admin = admin  # sees every tenant's instances and programs (ServerConfig.is_admin)
        self.counted = False  # counted in its tenant's connections (TenantLimits)
        self.auth_failures = 0
        self.upload: Upload | None = None
        self.instances: set[str] = set()
        self.closing = False
        self.dropped = False
        self.on_drop = on_drop
        # bytes = a frame to send; (code, reason) = close after what is queued; None = stop.
        self.outbox: asyncio.Queue[bytes | tuple[int, str] | None] = asyncio.Queue()

    def send(self, frame: bytes) -> None:
        """Queue one frame; a client that lets `max_queued` frames or `max_queued_bytes` pile up is dropped."""
        if self.closing:
            return
        if self.outbox.qsize() >= self.max_queued or self.queued_bytes + len(frame) > self.max_queued_bytes:
            # The client stopped reading: a close frame would wait behind the backlog, so the
            # connection ends now; the instances are released as usual.
            log.warning("connection %s: %d frames (%d bytes) queued, client not reading; dropping it", self.id,
                        self.outbox.qsize(), self.queued_bytes)
            self.drop()
            return
        self.queued_bytes += len(frame)
        self.outbox.put_nowait(frame)

    def drop(self) -> None:
        """End the connection now, without sending what is queued."""
        if self.dropped:
            return
        self.closing = self.dropped = True
        if self.on_drop is not None:
            self.on_drop()

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
                await self.ws.send_bytes(item)
            except (WebSocketDisconnect, WebSocketDisconnected, OSError):
                return
            finally:
                if isinstance(item, bytes):
                    self.queued_bytes -= len(item)
