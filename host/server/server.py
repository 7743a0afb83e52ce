"""The WebSocket server (`pie-serve`): protocol v1 in front of one host.

One asyncio task per connection reads frames in order and answers each request; a second task per
connection writes that connection's frames in order (see `Connection`). Instances belong to the
connection that launched them (see `InstanceTable`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from websockets.asyncio.server import Server as _WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from host.client import protocol as p
from host.server.config import HostFacade, ServerConfig
from host.server.connection import Connection, RequestError
from host.server.handlers import RequestHandlers, ServerCounters
from host.server.instances import InstanceTable
from host.server.programs import ProgramStore

__all__ = ["Server"]

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0


class Server:
    """Serves protocol v1 for `host`. Use `start`/`stop` inside a loop or `start_background` from sync code.

    `compile_errors` are the exceptions `host.compile` raises for a bad component (default: the
    wasm engine's `CompileError`); they are answered as a rejected upload.
    """

    def __init__(self, host: HostFacade, config: ServerConfig,
                 compile_errors: tuple[type[Exception], ...] | None = None) -> None:
        if compile_errors is None:
            from host.wasm.engine import CompileError  # here, not at the top: it loads wasmtime

            compile_errors = (CompileError,)
        self.host = host
        self.config = config
        self.store = ProgramStore(config.data_dir / "programs", host.compile, compile_errors)
        self.port: int | None = None
        self.connections: set[Connection] = set()
        self.counters = ServerCounters()
        self.instances = InstanceTable(host.terminate, config.event_buffer_limit)
        self.handlers = RequestHandlers(host, config, self.store, self.instances, self.connections, self.counters)
        self._ws_server: _WsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"ws://{self.config.host}:{self.port}"

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on the configured address (port 0 picks a free port, see `port`)."""
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        self._ws_server = await serve(self._handle, self.config.host, self.config.port,
                                      max_size=self.config.max_frame_bytes, compression=None)
        self.port = self._ws_server.sockets[0].getsockname()[1]
        log.info("pie-serve listening on %s (auth %s)", self.url, "on" if self.config.requires_auth else "off")

    async def stop(self) -> None:
        """Close every connection (terminating their instances), then terminate detached ones."""
        if self._ws_server is not None:
            self._ws_server.close()
            await self._ws_server.wait_closed()
        self.instances.terminate_all("server shutting down")

    async def serve_forever(self) -> None:
        """Start, run until `request_stop` (or SIGINT/SIGTERM when set up by `pie-serve`), stop."""
        await self.start()
        await self._wait_for_stop()

    async def _wait_for_stop(self) -> None:
        if self._stop_requested is None:
            raise RuntimeError("server not started: call start() first")
        await self._stop_requested.wait()
        await self.stop()

    def request_stop(self) -> None:
        """Thread-safe: ask `serve_forever` to stop."""
        if self._loop is not None and self._stop_requested is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._stop_requested.set)

    def start_background(self) -> None:
        """Run the server on its own event loop in a daemon thread; returns once it listens."""
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            try:
                await self.start()
            except BaseException as exc:
                failure.append(exc)
                raise
            finally:
                ready.set()
            await self._wait_for_stop()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="pie-serve", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def stop_background(self, timeout: float = 30.0) -> None:
        """Stop a server started with `start_background` and wait for its thread."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- connections -----------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        conn = Connection(ws, not self.config.requires_auth, self.config.max_queued_frames)
        self.connections.add(conn)
        self.counters.connections_total += 1
        sender = asyncio.create_task(conn.send_loop())
        try:
            async for frame in ws:
                await self._on_frame(conn, frame)
                if conn.closing:
                    break
        except ConnectionClosed as exc:
            # Includes a frame over max_size: websockets closes with 1009 and a reason itself.
            log.debug("connection %s closed: %s", ws.id, exc)
        finally:
            self.connections.discard(conn)
            self.instances.release(conn)
            conn.stop()
            try:
                await asyncio.wait_for(sender, timeout=FLUSH_TIMEOUT_S)
            except TimeoutError:
                log.warning("connection %s: could not flush its frames in %.0f s", ws.id, FLUSH_TIMEOUT_S)

    async def _on_frame(self, conn: Connection, frame: bytes | str) -> None:
        self.counters.requests += 1
        try:
            request = p.decode_request(frame)
        except p.ProtocolError as exc:
            self.counters.errors += 1
            if exc.corr_id is None:
                log.info("closing connection %s: %s", conn.ws.id, exc.reason)
                conn.close(exc.close_code, exc.reason)
            else:
                conn.send(p.encode_response(exc.corr_id, False, exc.reason))
            return
        try:
            result = await self.handlers.handle(conn, request)
        except RequestError as exc:
            self.counters.errors += 1
            self._reply(conn, request, False, str(exc))
        except Exception as exc:  # a bug must not take the connection or the server down
            log.exception("internal error handling %s", type(request).__name__)
            self.counters.errors += 1
            self._reply(conn, request, False, f"internal server error: {exc!r}")
        else:
            self._reply(conn, request, True, result)

    def _reply(self, conn: Connection, request: p.Request, ok: bool, result: Any) -> None:
        # signal_instance may omit corr_id: its errors are reported with corr_id null.
        if request.corr_id is not None or not ok:
            conn.send(p.encode_response(request.corr_id, ok, result))
