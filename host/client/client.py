"""Python client for protocol v1: `PieClient`, on asyncio (`SyncPieClient` wraps it for blocking code).

Example::

    async with await PieClient.connect("ws://127.0.0.1:8080", token=None) as client:
        program = await client.ensure_program(Path("app.wasm").read_bytes())
        iid = await client.launch(program, ["--prompt", "Hi"])
        async for event in client.events(iid):
            print(event.event, event.message)
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from host.client import protocol as p
from host.events import InstanceEvent

__all__ = ["PieClient", "Event", "PieError", "ConnectionLost"]

log = logging.getLogger(__name__)


class PieError(Exception):
    """The server refused a request; the message is the server's reason."""


class ConnectionLost(PieError):
    """The connection closed before the awaited response or terminal event arrived."""


# One `instance_event` frame: the same record the host hands its embedders.
Event = InstanceEvent


_CLOSED = object()  # put into event queues when the connection ends


class PieClient:
    """An open connection to a pie server. Create it with `PieClient.connect`."""

    def __init__(self, ws: ClientConnection) -> None:
        self._ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._events: dict[str, asyncio.Queue[Any]] = {}
        self._closed_reason: str | None = None
        self._reader = asyncio.create_task(self._read_loop())

    @classmethod
    async def connect(cls, url: str, *, token: str | None = None, open_timeout: float = 10.0) -> PieClient:
        """Open a connection (and authenticate when `token` is given)."""
        ws = await connect(url, max_size=None, compression=None, open_timeout=open_timeout)
        client = cls(ws)
        if token is not None:
            await client.authenticate(token)
        return client

    async def __aenter__(self) -> PieClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection; the server terminates this connection's non-detached instances."""
        await self._ws.close()
        await self._reader

    # ---- requests ---------------------------------------------------------------------------

    async def _send(self, msg: dict[str, Any]) -> None:
        if self._closed_reason is not None:
            raise ConnectionLost(self._closed_reason)
        try:
            await self._ws.send(p.pack(msg))
        except ConnectionClosed as exc:
            raise ConnectionLost(f"connection closed: {exc}") from exc

    async def _request(self, msg: dict[str, Any]) -> Any:
        return await (await self._start_request(msg))

    async def _start_request(self, msg: dict[str, Any]) -> asyncio.Future[Any]:
        corr_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[corr_id] = future
        try:
            await self._send(dict(msg, corr_id=corr_id))
        except BaseException:
            self._pending.pop(corr_id, None)
            raise
        return future

    async def authenticate(self, token: str) -> None:
        await self._request({"type": "authenticate", "token": token})

    async def ping(self) -> float:
        """Round-trip time in seconds."""
        start = asyncio.get_running_loop().time()
        await self._request({"type": "ping"})
        return asyncio.get_running_loop().time() - start

    async def logs(self, instance_id: str) -> list[dict[str, Any]]:
        """An instance's last log lines ({"t", "stream", "text"}), running or ended recently."""
        return list(await self.query("logs", instance_id))

    async def recording(self, instance_id: str) -> bytes:
        """The recording of an instance launched with `record`, once it has ended (the file
        `pie-replay` reads), fetched in pieces; PieError when there is none."""
        data = bytearray()
        while True:
            part = await self.query("recording", {"instance_id": instance_id, "offset": len(data)})
            if not (isinstance(part, dict) and isinstance(part.get("data"), bytes) and isinstance(part.get("total"), int)):
                raise PieError(f"unexpected answer to query recording: {part!r:.200}")
            data += part["data"]
            if len(data) >= part["total"] or not part["data"]:
                return bytes(data)

    async def query(self, subject: str, record: Any = None) -> Any:
        """`subject` is program_exists, models, instances or stats."""
        return await self._request({"type": "query", "subject": subject, "record": record})

    async def program_exists(self, program_hash: str) -> bool:
        return bool(await self.query("program_exists", program_hash))

    async def upload_program(self, data: bytes) -> str:
        """Upload a component in 256 KiB chunks (pipelined); returns its sha256 hex."""
        if not data:
            raise ValueError("cannot upload an empty program")
        program_hash = hashlib.sha256(data).hexdigest()
        chunks = [data[i:i + p.CHUNK_SIZE] for i in range(0, len(data), p.CHUNK_SIZE)]
        futures = []
        for index, chunk in enumerate(chunks):
            futures.append(await self._start_request({
                "type": "upload_program", "program_hash": program_hash, "chunk_index": index,
                "total_chunks": len(chunks), "chunk_data": chunk}))
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:  # the first failure explains the ones after it
            if isinstance(result, BaseException):
                raise result
        return str(results[-1])

    async def ensure_program(self, data: bytes) -> str:
        """Upload `data` unless the server already stores it; returns its hash."""
        program_hash = hashlib.sha256(data).hexdigest()
        if await self.program_exists(program_hash):
            return program_hash
        return await self.upload_program(data)

    async def launch(self, program_hash: str, arguments: Iterable[str] = (), *, detached: bool = False,
                     priority: int = 0, record: bool = False) -> str:
        """Start an instance; returns its id. Its events are buffered until read with `events`.
        `priority`: from -1000 to 1000, lower runs sooner (docs/protocol.md); `record`: record its
        host calls, fetched with `recording` once it has ended."""
        msg: dict[str, Any] = {"type": "launch_instance", "program_hash": program_hash,
                               "arguments": list(arguments), "detached": detached}
        if priority:
            msg["priority"] = priority
        if record:
            msg["record"] = True
        iid = await self._request(msg)
        self._queue(iid)
        return str(iid)

    async def signal(self, instance_id: str, message: str, *, wait: bool = True) -> None:
        """Send `message` to the instance's receive(). With wait=False no response is awaited
        (failures are then only logged)."""
        msg = {"type": "signal_instance", "instance_id": instance_id, "message": message}
        if wait:
            await self._request(msg)
        else:
            await self._send(msg)

    async def close_input(self, instance_id: str) -> None:
        """Tell the instance no more signals will come: its receive() then returns none."""
        await self._request({"type": "close_input", "instance_id": instance_id})

    async def terminate(self, instance_id: str) -> None:
        """Ask the server to end the instance; its `aborted` event follows."""
        await self._request({"type": "terminate_instance", "instance_id": instance_id})

    async def attach(self, instance_id: str) -> None:
        """Take over a detached instance; its buffered events follow."""
        self._queue(instance_id)
        await self._request({"type": "attach_instance", "instance_id": instance_id})

    async def events(self, instance_id: str) -> AsyncIterator[Event]:
        """The instance's events in order, ending with (and including) its terminal event.

        Raises:
            ConnectionLost: if the connection ends first.
        """
        queue = self._queue(instance_id)
        while True:
            item = await queue.get()
            if item is _CLOSED:
                raise ConnectionLost(f"connection lost before instance {instance_id} finished: "
                                     f"{self._closed_reason}")
            yield item
            if item.terminal:
                self._events.pop(instance_id, None)
                return

    # ---- reading ----------------------------------------------------------------------------

    def _queue(self, instance_id: str) -> asyncio.Queue[Any]:
        queue = self._events.get(instance_id)
        if queue is None:
            queue = self._events[instance_id] = asyncio.Queue()
            if self._closed_reason is not None:
                queue.put_nowait(_CLOSED)
        return queue

    async def _read_loop(self) -> None:
        reason = "connection closed"
        try:
            async for frame in self._ws:
                self._dispatch(p.decode_server_message(frame))
        except ConnectionClosed as exc:
            reason = f"connection closed: {exc}"
        except p.ProtocolError as exc:
            reason = f"protocol error: {exc}"
            await self._ws.close(p.CLOSE_INVALID_DATA, str(exc)[:120])
        else:
            code, why = self._ws.close_code, self._ws.close_reason
            if code is not None:
                reason = f"connection closed: code {code}" + (f", {why}" if why else "")
        self._closed_reason = reason
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionLost(reason))
        self._pending.clear()
        for queue in self._events.values():
            queue.put_nowait(_CLOSED)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "instance_event":
            event = Event(str(msg.get("instance_id")), str(msg.get("event")), str(msg.get("message")),
                          str(msg.get("stream") or ""))
            self._queue(event.instance_id).put_nowait(event)
            return
        future = self._pending.pop(msg.get("corr_id"), None)  # type: ignore[arg-type]
        if future is None:
            if not msg.get("successful"):
                log.warning("server error for a request without corr_id: %s", msg.get("result"))
            return
        if future.done():
            return
        if msg.get("successful"):
            future.set_result(msg.get("result"))
        else:
            future.set_exception(PieError(str(msg.get("result"))))
