"""The server (`pie-serve`): one port, one ASGI app (Starlette on uvicorn) in front of one host.

On that port: the WebSocket protocol v1 (docs/protocol.md, binary msgpack frames, any path), and
the HTTP routes `/health`, `/metrics`, the dashboard (`/dashboard`, host/server/dashboard.py) and,
when an OpenAI handler program is given, the OpenAI-compatible routes (host/server/openai_api.py,
docs/openai.md).

WebSocket: one task per connection reads frames in order and answers each request; a second task
per connection writes that connection's frames in order (see `Connection`). Instances belong to
the connection that launched them and to its tenant (see `InstanceTable`).

Bounds (each a `ServerConfig` field and a pie-serve flag): open connections (HTTP through
uvicorn's `limit_concurrency`, WebSocket upgrades here), connections per tenant (`TenantLimits`),
the time to authenticate, the time to send an HTTP request's headers (`host/server/http.py`),
bytes queued per connection, bytes in partial uploads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket

from host.client import protocol as p
from host.server.config import LOCAL_TENANT, HostFacade, ServerConfig
from host.server.connection import Connection, RequestError
from host.server.dashboard import Dashboard
from host.server.handlers import RequestHandlers, ServerCounters
from host.server.http import h11_with_header_timeout
from host.server.instances import InstanceTable
from host.server.metrics import ServerMetrics
from host.server.openai_api import OpenAIHandler, internal_error, openai_routes, service_routes
from host.server.openai_images import ImageLimits
from host.server.openai_responses import ResponseStore
from host.server.programs import ProgramStore
from host.server.tenants import TenantLimitError, TenantLimits

__all__ = ["Server"]

log = logging.getLogger(__name__)

FLUSH_TIMEOUT_S = 10.0
CLOSE_GOING_AWAY = 1001
# How long stop() lets open HTTP responses and WebSocket closes finish before cancelling them.
GRACEFUL_SHUTDOWN_S = 5
# How long stop() waits for the terminal events of the instances it terminated, before closing.
SHUTDOWN_EVENTS_S = 5.0


class _Uvicorn(uvicorn.Server):
    """uvicorn's server without its signal handling: `Server` (and `pie-serve`) own the lifecycle."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class Server:
    """Serves protocol v1 and the HTTP routes for `host`. Use `start`/`stop` inside a loop or
    `start_background` from sync code.

    `compile_errors` are the exceptions `host.compile` raises for a bad component (default: the
    wasm engine's `CompileError`); they are answered as a rejected upload. `openai_program` is the
    hash of a compiled OpenAI handler (e.g. inferlets/openai_chat): with it the OpenAI routes are
    served too, for model `model_name` (default: the host's first model); `embedding_program` (e.g.
    inferlets/openai_embed) answers their /v1/embeddings.
    """

    def __init__(self, host: HostFacade, config: ServerConfig,
                 compile_errors: tuple[type[Exception], ...] | None = None,
                 openai_program: str | None = None, model_name: str | None = None,
                 embedding_program: str | None = None) -> None:
        if compile_errors is None:
            from host.wasm.engine import CompileError  # here, not at the top: it loads wasmtime

            compile_errors = (CompileError,)
        self.host = host
        self.config = config
        self.store = ProgramStore(config.data_dir / "programs", host.compile, compile_errors,
                                  quota_bytes=config.max_store_bytes_per_tenant, ttl_s=config.program_ttl_s)
        children = getattr(host, "children", None)
        if children is not None:  # a child inferlet may start only what its tenant uploaded (or its own program)
            children.access = self._may_launch
        self.port: int | None = None
        self.connections: set[Connection] = set()
        self.counters = ServerCounters()
        self.metrics = ServerMetrics(host.stats, lambda: 0)
        self.limits = TenantLimits(config.max_instances_per_tenant, config.tenant_connection_cap)
        self.instances = InstanceTable(host.terminate, config.event_buffer_limit, self.metrics.instance_ended,
                                       self.limits, event_buffer_bytes=config.max_queued_bytes)
        self.handlers = RequestHandlers(host, config, self.store, self.instances, self.connections, self.counters,
                                        self.limits)
        self.openai: OpenAIHandler | None = None
        if openai_program is not None:
            self.openai = OpenAIHandler(host, openai_program, model_name or host.model_names()[0], self.metrics,
                                        auth_token=config.auth_token, tenants=config.tenants, limits=self.limits,
                                        max_body_bytes=config.max_body_bytes, read_timeout_s=config.read_timeout_s,
                                        write_timeout_s=config.write_timeout_s,
                                        max_queued_bytes=config.max_queued_bytes,
                                        responses=ResponseStore(config.responses_max_stored, config.responses_ttl_s),
                                        embedding_program=embedding_program,
                                        images=ImageLimits(config.max_image_bytes, config.max_images,
                                                           config.allow_remote_images),
                                        matryoshka=config.matryoshka)
        routes: list[BaseRoute] = (openai_routes(self.openai) if self.openai is not None
                                   else service_routes(self.metrics))
        self.dashboard = Dashboard(host, config, self.limits)
        routes.extend(self.dashboard.routes())
        # Protocol v1 clients connect to ws://host:port (any path: the old server took any).
        routes.append(WebSocketRoute("/{path:path}", self._websocket))
        self.app = Starlette(routes=routes, exception_handlers={Exception: internal_error})
        self._uvicorn: _Uvicorn | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested: asyncio.Event | None = None

    @property
    def url(self) -> str:
        """The WebSocket URL of protocol v1."""
        return f"ws://{self._url_host}:{self.port}"

    @property
    def http_url(self) -> str:
        """The base URL of the HTTP routes (the OpenAI client's `base_url` is this + "/v1")."""
        return f"http://{self._url_host}:{self.port}"

    @property
    def _url_host(self) -> str:
        return f"[{self.config.host}]" if ":" in self.config.host else self.config.host

    # ---- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen on the configured address (port 0 picks a free port, see `port`)."""
        self._loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.create_server((self.config.host, self.config.port), family=family)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app, ws="websockets-sansio", ws_max_size=self.config.max_frame_bytes,
            ws_per_message_deflate=False, lifespan="off", log_config=None, access_log=False,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, limit_concurrency=self.config.max_connections,
            http=h11_with_header_timeout(self.config.read_timeout_s))
        self._uvicorn = _Uvicorn(config)
        self._serve_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._serve_task.done():
                sock.close()
                self._serve_task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.005)
        log.info("pie-serve listening on %s (auth %s; HTTP %s%s)", self.url,
                 "on" if self.config.requires_auth else "off", self.http_url,
                 f", OpenAI routes for {self.openai.model!r}" if self.openai is not None else "")

    async def stop(self) -> None:
        """Terminate every instance and let its client have its terminal event (`aborted`, or an
        SSE error event and `[DONE]`), then close every connection and stop listening."""
        self.handlers.stopping = True
        self.dashboard.close()
        self.instances.terminate_all("server shutting down")
        if self.openai is not None:
            self.openai.terminate_all("server shutting down")
        deadline = asyncio.get_running_loop().time() + SHUTDOWN_EVENTS_S
        while not self._instances_ended() and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.close(CLOSE_GOING_AWAY, "server shutting down")
        if self._uvicorn is not None and self._serve_task is not None:
            self._uvicorn.should_exit = True
            await self._serve_task
        self.instances.terminate_all("server shutting down")

    def _instances_ended(self) -> bool:
        """Every instance's terminal event has reached its connection's queue (or its request)."""
        return (all(r.finished for r in self.instances.records.values())
                and (self.openai is None or not self.openai.running))

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

    # ---- WebSocket connections -------------------------------------------------------------

    def _may_launch(self, tenant: str, program_hash: str) -> bool:
        """Whether a child inferlet of `tenant` may start `program_hash`: one the tenant stored (the admin:
        any stored), compiled from the store if it is not compiled yet (on the parent's thread)."""
        if not self.store.visible(tenant, program_hash, admin=self.config.is_admin(tenant)):
            return False
        try:
            self.store.ensure_compiled(program_hash)
        except Exception:  # (evicted meanwhile, or it no longer compiles): as if unknown
            return False
        return True

    async def _websocket(self, ws: WebSocket) -> None:
        cfg = self.config
        if not await self._admit(ws):
            return
        try:
            await ws.accept()
        except BaseException:
            if not cfg.requires_auth:
                self.limits.give_connection(LOCAL_TENANT)
            raise
        reader = asyncio.current_task()
        assert reader is not None
        reading = False

        def drop() -> None:  # the client stopped reading: end this connection now
            if reading:
                reader.cancel()

        conn = Connection(ws, not cfg.requires_auth, cfg.max_queued_frames, drop, cfg.max_queued_bytes,
                          admin=not cfg.requires_auth)
        conn.counted = not cfg.requires_auth
        self.connections.add(conn)
        self.counters.connections_total += 1
        sender = asyncio.create_task(conn.send_loop())
        auth_timer = (asyncio.get_running_loop().call_later(cfg.auth_timeout_s, self._auth_timeout, conn)
                      if cfg.requires_auth else None)
        try:
            while not conn.closing:
                reading = True
                message = await ws.receive()
                reading = False
                if message["type"] == "websocket.disconnect":
                    # Includes a frame over max_size: the protocol closes with 1009 and a reason itself.
                    log.debug("connection %s closed: %s %s", conn.id, message.get("code"), message.get("reason"))
                    break
                frame = message.get("bytes")
                await self._on_frame(conn, frame if frame is not None else message.get("text") or "")
        except asyncio.CancelledError:
            if not conn.dropped:
                raise
            reader.uncancel()
        finally:
            if auth_timer is not None:
                auth_timer.cancel()
            await self._end(conn, sender)

    async def _admit(self, ws: WebSocket) -> bool:
        """Whether a new WebSocket may open: the server's cap, and on a server without tokens the
        one tenant's (counted here; with tokens a connection counts from its authentication).
        A refused upgrade is answered HTTP 503 with the reason."""
        cfg = self.config
        reason = None
        if len(self.connections) >= cfg.max_connections:
            reason = f"the server has its maximum of {cfg.max_connections} connections open (--max-connections)"
        elif not cfg.requires_auth:
            try:
                self.limits.take_connection(LOCAL_TENANT)
            except TenantLimitError as exc:
                reason = str(exc)
        if reason is None:
            return True
        await ws.send_denial_response(PlainTextResponse(reason, 503))
        return False

    async def _end(self, conn: Connection, sender: asyncio.Task[None]) -> None:
        """The connection is over: give back what it held, end its instances, flush its frames."""
        if conn.counted:
            self.limits.give_connection(conn.tenant)
        self.handlers.discard_upload(conn)
        self.connections.discard(conn)
        self.instances.release(conn)
        conn.stop()
        if conn.dropped:
            sender.cancel()
        try:
            await asyncio.wait_for(sender, timeout=FLUSH_TIMEOUT_S)
        except TimeoutError:
            log.warning("connection %s: could not flush its frames in %.0f s", conn.id, FLUSH_TIMEOUT_S)
        except asyncio.CancelledError:
            if not conn.dropped:
                raise

    def _auth_timeout(self, conn: Connection) -> None:
        if not conn.authenticated and not conn.closing:
            log.info("closing connection %s: not authenticated within %g s", conn.id, self.config.auth_timeout_s)
            conn.close(p.CLOSE_POLICY, f"not authenticated within {self.config.auth_timeout_s:g} s")

    async def _on_frame(self, conn: Connection, frame: bytes | str) -> None:
        self.counters.requests += 1
        try:
            request = p.decode_request(frame)
        except p.ProtocolError as exc:
            self.counters.errors += 1
            if exc.corr_id is None:
                log.info("closing connection %s: %s", conn.id, exc.reason)
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
