"""The WebSocket server (`pie-serve`): protocol v1 in front of one `Host`.

One asyncio task per connection reads frames in order and answers each request; a second task per
connection writes that connection's frames in order (responses and instance events share one
queue, so a launch's response always precedes the instance's first event). Instances belong to the
connection that launched them: a disconnect terminates them, unless launched detached.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import logging
import os
import signal
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from websockets.asyncio.server import Server as _WsServer
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from host import protocol as p
from host.programs import DEFAULT_MAX_PROGRAM_BYTES, ProgramRejected, ProgramStore, Upload, UploadError

if TYPE_CHECKING:
    from host.runtime import Host, InstanceEvent

__all__ = ["Server", "ServerConfig", "serve_main", "default_data_dir"]

log = logging.getLogger(__name__)

MAX_AUTH_FAILURES = 3


def default_data_dir() -> Path:
    """`$PIE_DATA_DIR`, else the host's cache dir (`$PIE_CACHE_DIR` or ~/.cache/pie-python)."""
    from host.config import default_cache_dir

    env = os.environ.get("PIE_DATA_DIR")
    return Path(env) if env else default_cache_dir()


@dataclass(frozen=True)
class ServerConfig:
    """Network and protocol settings; the host's own settings live in `HostConfig`."""

    host: str = "127.0.0.1"
    port: int = 8080
    auth_token: str | None = None
    data_dir: Path = field(default_factory=default_data_dir)
    max_frame_bytes: int = p.MAX_FRAME_BYTES
    max_program_bytes: int = DEFAULT_MAX_PROGRAM_BYTES
    # Events kept for a detached instance while no connection is attached; older ones are dropped.
    event_buffer_limit: int = 10_000
    # Frames queued for a client that does not read; past this the connection is dropped.
    max_queued_frames: int = 65_536


class RequestError(Exception):
    """A well-formed request that cannot be carried out; the message goes back to the client."""


class _Connection:
    def __init__(self, ws: ServerConnection, authenticated: bool, max_queued: int) -> None:
        self.ws = ws
        self.max_queued = max_queued
        self.authenticated = authenticated
        self.auth_failures = 0
        self.upload: Upload | None = None
        self.instances: set[str] = set()
        self.closing = False
        # bytes = a frame to send; (code, reason) = close after what is queued; None = stop.
        self.outbox: asyncio.Queue[bytes | tuple[int, str] | None] = asyncio.Queue()

    def send(self, frame: bytes) -> None:
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
        if not self.closing:
            self.closing = True
            # A close reason must fit in 123 UTF-8 bytes.
            self.outbox.put_nowait((code, reason.encode()[:123].decode(errors="ignore")))


@dataclass(eq=False)
class _Instance:
    program: str
    detached: bool
    owner: _Connection | None
    id: str = ""
    finished: bool = False
    buffer: deque[bytes] = field(default_factory=deque)
    dropped: int = 0


class Server:
    """Serves protocol v1 for `host`. Use `start`/`stop` inside a loop or `start_background` from sync code."""

    def __init__(self, host: Host, config: ServerConfig,
                 compile_errors: tuple[type[Exception], ...] | None = None) -> None:
        if compile_errors is None:
            from host.runtime import CompileError
            compile_errors = (CompileError,)
        self.host = host
        self.config = config
        self.store = ProgramStore(config.data_dir / "programs", host.compile, compile_errors)
        self.port: int | None = None
        self._instances: dict[str, _Instance] = {}
        self._connections: set[_Connection] = set()
        self._finished_detached: deque[str] = deque()
        self._ws_server: _WsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_requested: asyncio.Event | None = None
        self._counters = {"connections_total": 0, "requests": 0, "errors": 0, "launched": 0, "uploads": 0}
        self._handlers: dict[type, Callable[[_Connection, Any], Awaitable[Any]]] = {
            p.Authenticate: self._authenticate, p.Ping: self._ping, p.Query: self._query,
            p.UploadProgram: self._upload, p.LaunchInstance: self._launch, p.SignalInstance: self._signal, p.CloseInput: self._close_input,
            p.TerminateInstance: self._terminate, p.AttachInstance: self._attach,
        }

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
        log.info("pie-serve listening on %s (auth %s)", self.url, "on" if self.config.auth_token else "off")

    async def stop(self) -> None:
        """Close every connection (terminating their instances), then terminate detached ones."""
        if self._ws_server is not None:
            self._ws_server.close()
            await self._ws_server.wait_closed()
        for record in list(self._instances.values()):
            if not record.finished:
                self._terminate_quietly(record.id, "server shutting down")

    async def serve_forever(self) -> None:
        """Start, run until `request_stop` (or SIGINT/SIGTERM when set up by `serve_main`), stop."""
        await self.start()
        assert self._stop_requested is not None
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
            assert self._stop_requested is not None
            await self._stop_requested.wait()
            await self.stop()

        self._thread = threading.Thread(target=asyncio.run, args=(main(),), name="pie-serve", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]

    def stop_background(self, timeout: float = 30.0) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- connections -----------------------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        conn = _Connection(ws, self.config.auth_token is None, self.config.max_queued_frames)
        self._connections.add(conn)
        self._counters["connections_total"] += 1
        sender = asyncio.create_task(self._send_loop(conn))
        try:
            async for frame in ws:
                await self._on_frame(conn, frame)
                if conn.closing:
                    break
        except ConnectionClosed as exc:
            # Includes a frame over max_size: websockets closes with 1009 and a reason itself.
            log.debug("connection %s closed: %s", ws.id, exc)
        finally:
            self._connections.discard(conn)
            self._release(conn)
            conn.outbox.put_nowait(None)
            try:
                await asyncio.wait_for(sender, timeout=10)
            except TimeoutError:
                log.warning("connection %s: could not flush its frames in 10 s", ws.id)

    async def _send_loop(self, conn: _Connection) -> None:
        while True:
            item = await conn.outbox.get()
            if item is None:
                return
            try:
                if isinstance(item, tuple):
                    await conn.ws.close(*item)
                    return
                await conn.ws.send(item)
            except ConnectionClosed:
                return

    async def _on_frame(self, conn: _Connection, frame: bytes | str) -> None:
        self._counters["requests"] += 1
        try:
            request = p.decode_request(frame)
        except p.ProtocolError as exc:
            self._counters["errors"] += 1
            if exc.corr_id is None:
                log.info("closing connection %s: %s", conn.ws.id, exc.reason)
                conn.close(exc.close_code, exc.reason)
            else:
                conn.send(p.encode_response(exc.corr_id, False, exc.reason))
            return
        try:
            if not conn.authenticated and not isinstance(request, p.Authenticate | p.Ping):
                raise RequestError("not authenticated: send authenticate with the server's token first")
            result = await self._handlers[type(request)](conn, request)
        except RequestError as exc:
            self._counters["errors"] += 1
            self._reply(conn, request, False, str(exc))
        except Exception as exc:  # a bug must not take the connection or the server down
            log.exception("internal error handling %s", type(request).__name__)
            self._counters["errors"] += 1
            self._reply(conn, request, False, f"internal server error: {exc!r}")
        else:
            self._reply(conn, request, True, result)

    def _reply(self, conn: _Connection, request: p.Request, ok: bool, result: Any) -> None:
        # signal_instance may omit corr_id: its errors are reported with corr_id null.
        if request.corr_id is not None or not ok:
            conn.send(p.encode_response(request.corr_id, ok, result))

    def _release(self, conn: _Connection) -> None:
        """The connection is gone: detach its detached instances, terminate the others."""
        for iid in conn.instances:
            record = self._instances.get(iid)
            if record is None or record.owner is not conn:
                continue
            record.owner = None
            if record.finished:
                self._forget(record)
            elif not record.detached:
                self._terminate_quietly(iid, "client disconnected")
        conn.instances.clear()

    def _terminate_quietly(self, iid: str, reason: str) -> None:
        try:
            self.host.terminate(iid, reason)
        except KeyError:
            log.debug("instance %s already ended before terminate(%r)", iid, reason)

    # ---- instance events (called on the loop via call_soon_threadsafe) -------------------

    def _on_event(self, record: _Instance, event: InstanceEvent) -> None:
        frame = p.encode_event(event.instance_id, event.event, event.message)
        owner = record.owner
        if owner is not None and not record.buffer:
            owner.send(frame)
        elif owner is not None or record.detached:
            record.buffer.append(frame)
            if len(record.buffer) > self.config.event_buffer_limit:
                record.buffer.popleft()
                record.dropped += 1
        if event.event in p.TERMINAL_EVENTS:
            record.finished = True
            if owner is None and record.detached:
                self._finished_detached.append(record.id)
                self._evict_finished_detached()
            elif owner is None or not record.buffer:
                self._forget(record)

    def _flush(self, record: _Instance) -> None:
        owner = record.owner
        if owner is None:
            return
        if record.dropped:
            log.warning("instance %s: %d buffered events were dropped before attach", record.id, record.dropped)
        while record.buffer:
            owner.send(record.buffer.popleft())
        if record.finished:
            self._forget(record)

    def _forget(self, record: _Instance) -> None:
        self._instances.pop(record.id, None)
        if record.owner is not None:
            record.owner.instances.discard(record.id)

    def _evict_finished_detached(self) -> None:
        # Finished detached instances nobody attached to are kept (for their events) up to a bound.
        while len(self._finished_detached) > 1024:
            record = self._instances.get(self._finished_detached.popleft())
            if record is not None and record.owner is None:
                self._forget(record)

    def _event_sink(self, record: _Instance) -> Callable[[InstanceEvent], None]:
        loop = self._loop
        assert loop is not None

        def on_event(event: InstanceEvent) -> None:  # runs on the instance's thread
            try:
                loop.call_soon_threadsafe(self._on_event, record, event)
            except RuntimeError:  # loop closed: the server has stopped, nobody can receive it
                log.debug("dropping %s event of %s: server stopped", event.event, event.instance_id)

        return on_event

    # ---- request handlers ------------------------------------------------------------------

    async def _authenticate(self, conn: _Connection, req: p.Authenticate) -> str:
        expected = self.config.auth_token
        if expected is None or hmac.compare_digest(req.token.encode(), expected.encode()):
            conn.authenticated = True
            return "authenticated"
        conn.auth_failures += 1
        if conn.auth_failures >= MAX_AUTH_FAILURES:
            conn.send(p.encode_response(req.corr_id, False, "invalid token"))
            conn.close(p.CLOSE_POLICY, f"{MAX_AUTH_FAILURES} failed authentication attempts")
        raise RequestError("invalid token")

    async def _ping(self, conn: _Connection, req: p.Ping) -> str:
        return "pong"

    async def _query(self, conn: _Connection, req: p.Query) -> Any:
        if req.subject == "program_exists":
            if not isinstance(req.record, str):
                raise RequestError(f"query program_exists: record must be a program hash string, got {req.record!r:.80}")
            return self.store.exists(req.record)
        if req.subject == "models":
            return self.host.model_names()
        if req.subject == "instances":
            return [self._describe(info) for info in self.host.instances()]
        server = dict(self._counters, connections=len(self._connections), instances=len(self._instances),
                      programs=len(self.store.hashes()))
        return {"host": self.host.stats(), "server": server}

    def _describe(self, info: dict[str, Any]) -> dict[str, Any]:
        record = self._instances.get(info["id"])
        return dict(info, detached=bool(record and record.detached),
                    attached=bool(record and record.owner is not None))

    async def _upload(self, conn: _Connection, req: p.UploadProgram) -> Any:
        try:
            if req.chunk_index == 0:
                conn.upload = Upload(req.program_hash, req.total_chunks, self.config.max_program_bytes)
            elif conn.upload is None:
                raise UploadError(f"out-of-order chunk: got chunk_index {req.chunk_index} with no upload "
                                  "in progress (start at chunk 0)")
            done = conn.upload.add(req.program_hash, req.chunk_index, req.total_chunks, req.chunk_data)
            if not done:
                return req.chunk_index
            data = conn.upload.finish()
        except UploadError as exc:
            conn.upload = None
            raise RequestError(f"upload_program: {exc}; upload discarded, restart at chunk 0") from exc
        conn.upload = None
        try:
            program_hash = await asyncio.to_thread(self.store.put, data)
        except ProgramRejected as exc:
            raise RequestError(f"upload_program: program {req.program_hash} failed to compile: {exc}") from exc
        self._counters["uploads"] += 1
        return program_hash

    async def _launch(self, conn: _Connection, req: p.LaunchInstance) -> str:
        if not self.store.exists(req.program_hash):
            raise RequestError(f"launch_instance: unknown program {req.program_hash}; upload it first")
        try:
            await asyncio.to_thread(self.store.ensure_compiled, req.program_hash)
        except ProgramRejected as exc:
            raise RequestError(f"launch_instance: stored program no longer compiles: {exc}") from exc
        record = _Instance(program=req.program_hash, detached=req.detached, owner=conn)
        try:
            iid = self.host.launch(req.program_hash, list(req.arguments), self._event_sink(record))
        except KeyError as exc:
            raise RequestError(f"launch_instance: host does not know program {req.program_hash}") from exc
        record.id = iid
        self._instances[iid] = record
        # A disconnect is handled after this request finishes (same task), so _release sees it.
        conn.instances.add(iid)
        self._counters["launched"] += 1
        return iid

    def _owned(self, conn: _Connection, kind: str, iid: str) -> _Instance:
        record = self._instances.get(iid)
        if record is None or record.finished:
            raise RequestError(f"{kind}: unknown or finished instance {iid!r}")
        if record.owner is not conn:
            hint = "; attach_instance first" if record.detached and record.owner is None else ""
            raise RequestError(f"{kind}: instance {iid} is not attached to this connection{hint}")
        return record

    async def _signal(self, conn: _Connection, req: p.SignalInstance) -> None:
        self._owned(conn, "signal_instance", req.instance_id)
        try:
            self.host.signal(req.instance_id, req.message)
        except KeyError as exc:
            raise RequestError(f"signal_instance: instance {req.instance_id} has finished") from exc

    async def _close_input(self, conn: _Connection, req: p.CloseInput) -> None:
        self._owned(conn, "close_input", req.instance_id)
        try:
            self.host.close_input(req.instance_id)
        except KeyError as exc:
            raise RequestError(f"close_input: instance {req.instance_id} has finished") from exc

    async def _terminate(self, conn: _Connection, req: p.TerminateInstance) -> None:
        self._owned(conn, "terminate_instance", req.instance_id)
        try:
            self.host.terminate(req.instance_id, "terminated by request")
        except KeyError as exc:
            raise RequestError(f"terminate_instance: instance {req.instance_id} has finished") from exc

    async def _attach(self, conn: _Connection, req: p.AttachInstance) -> None:
        record = self._instances.get(req.instance_id)
        if record is None:
            raise RequestError(f"attach_instance: unknown instance {req.instance_id!r}")
        if record.owner is conn:
            return None
        if record.owner is not None:
            raise RequestError(f"attach_instance: instance {req.instance_id} is attached to another connection")
        if not record.detached:
            raise RequestError(f"attach_instance: instance {req.instance_id} was not launched detached")
        record.owner = conn
        conn.instances.add(record.id)
        # Buffered events go out after this request's response (queued right after we return).
        asyncio.get_running_loop().call_soon(self._flush, record)
        return None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="pie-serve", description="Serve inferlets over WebSocket (protocol v1).")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (0 picks a free one; default 8080)")
    ap.add_argument("--auth-token", default=os.environ.get("PIE_AUTH_TOKEN"),
                    help="require this token (default: $PIE_AUTH_TOKEN; none = no authentication)")
    ap.add_argument("--model", help="GGUF file or HF safetensors dir (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="weights/KV dtype (default: float32 on CPU, bfloat16 on CUDA)")
    ap.add_argument("--page-size", type=int, help="tokens per KV page")
    budget = ap.add_mutually_exclusive_group()
    budget.add_argument("--num-pages", type=int, help="KV pages to preallocate")
    budget.add_argument("--kv-memory", type=int, metavar="MB", help="KV cache size in MiB (instead of --num-pages)")
    ap.add_argument("--policy", choices=["adaptive", "k-or-t"], help="batching policy")
    ap.add_argument("--max-batch-tokens", type=int, help="cap on tokens per batch")
    ap.add_argument("--memory-limit-mb", type=int, help="linear memory limit per instance (MiB)")
    ap.add_argument("--wall-budget-s", type=float, help="wall-clock budget per instance (seconds)")
    ap.add_argument("--max-pages-per-instance", type=int, help="KV pages one instance may hold")
    ap.add_argument("--data-dir", type=Path, default=default_data_dir(),
                    help="program store and key-value store (default: $PIE_DATA_DIR or the host cache dir)")
    ap.add_argument("--max-frame-bytes", type=int, default=p.MAX_FRAME_BYTES,
                    help=f"largest accepted WebSocket frame (default {p.MAX_FRAME_BYTES})")
    ap.add_argument("--max-program-mb", type=int, default=DEFAULT_MAX_PROGRAM_BYTES // 2**20,
                    help=f"largest accepted program (default {DEFAULT_MAX_PROGRAM_BYTES // 2**20} MiB)")
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return ap.parse_args(argv)


def host_config_from_args(args: argparse.Namespace) -> Any:
    """A `HostConfig` with the options that were given; the rest keep the host's defaults."""
    from host.runtime import HostConfig

    mib = 1024 * 1024
    given: dict[str, Any] = {
        "model": args.model, "device": args.device, "dtype": args.dtype, "page_size": args.page_size, "num_pages": args.num_pages,
        "kv_memory_bytes": args.kv_memory * mib if args.kv_memory is not None else None,
        "policy": args.policy, "max_batch_tokens": args.max_batch_tokens,
        "memory_limit_bytes": args.memory_limit_mb * mib if args.memory_limit_mb is not None else None,
        "wall_budget_s": args.wall_budget_s, "max_pages_per_instance": args.max_pages_per_instance,
        "data_dir": args.data_dir,
    }
    return HostConfig(**{k: v for k, v in given.items() if v is not None})


def serve_main(argv: list[str] | None = None) -> int:
    """Entry point of `pie-serve`: load the host and serve until SIGINT/SIGTERM."""
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from host.runtime import Host

    try:
        config = host_config_from_args(args)
    except ValueError as exc:
        print(f"pie-serve: {exc}", file=sys.stderr)
        return 2
    host = Host(config)
    server = Server(host, ServerConfig(host=args.host, port=args.port, auth_token=args.auth_token or None,
                                       data_dir=args.data_dir, max_frame_bytes=args.max_frame_bytes,
                                       max_program_bytes=args.max_program_mb * 2**20))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_stop)
        await server.serve_forever()

    try:
        asyncio.run(main())
    finally:
        host.shutdown()
    return 0
