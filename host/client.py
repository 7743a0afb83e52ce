"""Python client for protocol v1: `PieClient` (asyncio), `SyncPieClient`, and `run_remote` for `pie-run --server`.

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
import sys
import threading
from collections.abc import AsyncIterator, Coroutine, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed

from host import protocol as p

__all__ = ["PieClient", "SyncPieClient", "Event", "PieError", "ConnectionLost", "run_remote", "EXIT_CODES"]

log = logging.getLogger(__name__)
T = TypeVar("T")

# Exit status of `run_remote` per terminal event, as the embedded `pie-run` uses them;
# a failure before the instance ends (connect, upload, launch, lost connection) exits 1.
EXIT_CODES = {"completed": 0, "exception": 1, "out_of_resources": 1, "aborted": 130}
EXIT_CLIENT_ERROR = 1


class PieError(Exception):
    """The server refused a request; the message is the server's reason."""


class ConnectionLost(PieError):
    """The connection closed before the awaited response or terminal event arrived."""


@dataclass(frozen=True)
class Event:
    """One `instance_event` frame."""

    instance_id: str
    event: str
    message: str

    @property
    def terminal(self) -> bool:
        return self.event in p.TERMINAL_EVENTS


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

    async def launch(self, program_hash: str, arguments: Iterable[str] = (), *, detached: bool = False) -> str:
        """Start an instance; returns its id. Its events are buffered until read with `events`."""
        iid = await self._request({"type": "launch_instance", "program_hash": program_hash,
                                   "arguments": list(arguments), "detached": detached})
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
            event = Event(str(msg.get("instance_id")), str(msg.get("event")), str(msg.get("message")))
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


class SyncPieClient:
    """Blocking wrapper around `PieClient`; runs its own event loop in a daemon thread."""

    def __init__(self, url: str, *, token: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pie-client", daemon=True)
        self._thread.start()
        self._client: PieClient = self._call(PieClient.connect(url, token=token))

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __enter__(self) -> SyncPieClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def ping(self) -> float:
        return self._call(self._client.ping())

    def query(self, subject: str, record: Any = None) -> Any:
        return self._call(self._client.query(subject, record))

    def program_exists(self, program_hash: str) -> bool:
        return self._call(self._client.program_exists(program_hash))

    def upload_program(self, data: bytes) -> str:
        return self._call(self._client.upload_program(data))

    def ensure_program(self, data: bytes) -> str:
        return self._call(self._client.ensure_program(data))

    def launch(self, program_hash: str, arguments: Iterable[str] = (), *, detached: bool = False) -> str:
        return self._call(self._client.launch(program_hash, arguments, detached=detached))

    def signal(self, instance_id: str, message: str) -> None:
        self._call(self._client.signal(instance_id, message))

    def terminate(self, instance_id: str) -> None:
        self._call(self._client.terminate(instance_id))

    def attach(self, instance_id: str) -> None:
        self._call(self._client.attach(instance_id))

    def events(self, instance_id: str) -> Iterator[Event]:
        """The instance's events, blocking, ending with its terminal event."""
        stream = self._client.events(instance_id)

        async def step() -> Event | None:
            return await anext(stream, None)

        while (event := self._call(step())) is not None:
            yield event


def run_remote(url: str, wasm_path: Path, args: list[str], *, token: str | None = None,
               stdin_lines: Iterable[str] | None = None) -> int:
    """Run one inferlet on a server, like `pie-run` does locally; returns the exit status.

    Uploads the program if the server lacks it, launches it, prints its messages to stdout and its
    return value at the end. Lines from `stdin_lines` are sent as signals as they come; when they
    run out nothing more is sent. Exit status: see `EXIT_CODES`; reasons go to stderr.
    """
    try:
        data = Path(wasm_path).read_bytes()
    except OSError as exc:
        print(f"pie-run: cannot read {wasm_path}: {exc}", file=sys.stderr)
        return EXIT_CLIENT_ERROR
    return asyncio.run(_run_remote(url, data, args, token, stdin_lines))


async def _run_remote(url: str, data: bytes, args: list[str], token: str | None,
                      stdin_lines: Iterable[str] | None) -> int:
    try:
        client = await PieClient.connect(url, token=token)
    except (OSError, TimeoutError, PieError) as exc:
        print(f"pie-run: cannot connect to {url}: {exc}", file=sys.stderr)
        return EXIT_CLIENT_ERROR
    forwarder: asyncio.Task[None] | None = None
    try:
        iid = await client.launch(await client.ensure_program(data), args)
        if stdin_lines is not None:
            forwarder = asyncio.create_task(_forward_lines(client, iid, stdin_lines))
        async for event in client.events(iid):
            if event.event == "message":
                print(event.message, flush=True)
            elif event.event == "completed":
                if event.message:
                    print(event.message, flush=True)
                return 0
            else:
                print(f"pie-run: inferlet {event.event}: {event.message}", file=sys.stderr)
                return EXIT_CODES.get(event.event, 1)
        raise ConnectionLost("event stream ended without a terminal event")
    except PieError as exc:
        print(f"pie-run: {exc}", file=sys.stderr)
        return EXIT_CLIENT_ERROR
    finally:
        if forwarder is not None:
            forwarder.cancel()
        await client.close()


async def _forward_lines(client: PieClient, instance_id: str, lines: Iterable[str]) -> None:
    """Send each line as a signal; reads `lines` on a daemon thread (stdin blocks)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    def pump() -> None:
        try:
            for line in lines:
                loop.call_soon_threadsafe(queue.put_nowait, line.rstrip("\r\n"))
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except RuntimeError:  # the run already ended and its loop is closed: nobody to send to
            return

    threading.Thread(target=pump, name="pie-run-stdin", daemon=True).start()
    try:
        while (line := await queue.get()) is not None:
            await client.signal(instance_id, line)
        await client.close_input(instance_id)  # EOF: receive() returns none, like the embedded pie-run
    except PieError as exc:  # typically: the instance finished while input was still coming
        log.info("stopped forwarding input: %s", exc)
