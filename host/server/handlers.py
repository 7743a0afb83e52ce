"""The protocol v1 requests, one handler each: authentication, queries, uploads, instance control.

A handler returns the response's result or raises `RequestError` with the reason sent back; it
reaches the host only through the `HostFacade` methods. Every handler acts only on what the
connection's tenant owns (instances, programs); the admin identity (`ServerConfig.is_admin`)
sees every tenant's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

from host.client import protocol as p
from host.host import HostBusy, InboxFull
from host.server.config import LOCAL_TENANT, HostFacade, ServerConfig
from host.server.connection import Connection, RequestError
from host.server.instances import InstanceRecord, InstanceTable
from host.server.programs import (
    ProgramRejected,
    ProgramStore,
    ProgramTooLarge,
    Upload,
    UploadBudget,
    UploadError,
)
from host.server.tenants import TenantLimitError, TenantLimits

__all__ = ["RequestHandlers", "ServerCounters", "MAX_AUTH_FAILURES"]

MAX_AUTH_FAILURES = 3


@dataclass
class ServerCounters:
    """Totals since start, reported by `query stats`."""

    connections_total: int = 0
    requests: int = 0
    errors: int = 0
    launched: int = 0
    uploads: int = 0


class RequestHandlers:
    """Carries out decoded requests for one server."""

    def __init__(self, host: HostFacade, config: ServerConfig, store: ProgramStore, instances: InstanceTable,
                 connections: set[Connection], counters: ServerCounters, limits: TenantLimits) -> None:
        self.host = host
        self.config = config
        self.store = store
        self.instances = instances
        self.connections = connections
        self.counters = counters
        self.limits = limits
        self.uploads = UploadBudget(config.max_upload_bytes_in_flight, min_share=config.max_program_bytes)
        self.stopping = False  # the server is shutting down: no more launches
        self._table: dict[type, Callable[[Connection, Any], Awaitable[Any]]] = {
            p.Authenticate: self._authenticate, p.Ping: self._ping, p.Query: self._query,
            p.UploadProgram: self._upload, p.LaunchInstance: self._launch, p.SignalInstance: self._signal,
            p.CloseInput: self._close_input, p.TerminateInstance: self._terminate, p.AttachInstance: self._attach,
        }

    async def handle(self, conn: Connection, request: p.Request) -> Any:
        """The result for `request` from `conn`; raises RequestError with the reason to send back."""
        if not conn.authenticated and not isinstance(request, p.Authenticate | p.Ping):
            raise RequestError("not authenticated: send authenticate with the server's token first")
        return await self._table[type(request)](conn, request)

    async def _authenticate(self, conn: Connection, req: p.Authenticate) -> str:
        if not self.config.requires_auth:
            conn.authenticated = True
            return "authenticated"
        tenant = self.config.tenant_for(req.token)
        if tenant is not None and conn.authenticated:
            if tenant != conn.tenant:
                raise RequestError(f"already authenticated as another tenant ({conn.tenant!r}); "
                                   "open a new connection to act as another one")
            return "authenticated"
        if tenant is not None:
            try:
                self.limits.take_connection(tenant)
            except TenantLimitError as exc:
                conn.send(p.encode_response(req.corr_id, False, str(exc)))
                conn.close(p.CLOSE_POLICY, "too many connections for this tenant")
                raise RequestError(str(exc)) from None
            conn.authenticated, conn.tenant, conn.counted = True, tenant, True
            conn.admin = self.config.is_admin(tenant)
            return "authenticated"
        conn.auth_failures += 1
        if conn.auth_failures >= MAX_AUTH_FAILURES:
            conn.send(p.encode_response(req.corr_id, False, "invalid token"))
            conn.close(p.CLOSE_POLICY, f"{MAX_AUTH_FAILURES} failed authentication attempts")
        raise RequestError("invalid token")

    async def _ping(self, conn: Connection, req: p.Ping) -> str:
        return "pong"

    async def _query(self, conn: Connection, req: p.Query) -> Any:
        if req.subject == "program_exists":
            if not isinstance(req.record, str) or p.HASH_RE.fullmatch(req.record) is None:
                shown = repr(req.record)[:80]
                raise RequestError("query program_exists: record must be a program hash (sha256 as 64 lowercase "
                                   f"hex digits), got {shown}")
            return self.store.visible(conn.tenant, req.record, conn.admin)
        if req.subject == "models":
            return self.host.model_names()
        if req.subject == "logs":  # an instance's log lines, running or ended recently: its tenant's (or the admin's)
            if not isinstance(req.record, str):
                raise RequestError(f"query logs: record must be an instance id, got {repr(req.record)[:80]}")
            lines = getattr(self.host, "logs", lambda *_a: None)(req.record, None if conn.admin else conn.tenant)
            if lines is None:
                raise RequestError(f"query logs: unknown instance {req.record[:80]!r} (or its log has expired)")
            return lines
        if req.subject == "recording":  # a recorded instance's calls once it has ended: its tenant's (or the admin's)
            iid, offset = _recording_record(req.record)
            data = self.host.recording(iid, None if conn.admin else conn.tenant)
            if data is None:
                raise RequestError(f"query recording: no recording of instance {iid[:80]!r} (unknown, not launched "
                                   "with \"record\": true, not ended yet, or forgotten: the host keeps the last 64)")
            if offset > len(data):
                raise RequestError(f"query recording: offset {offset} is past the recording's {len(data)} bytes")
            return {"total": len(data), "offset": offset, "data": data[offset:offset + p.RECORDING_CHUNK]}
        if req.subject == "instances":
            # Another tenant's instances (their arguments are prompts) are not shown, except to the admin.
            return [self._describe(info) for info in self.host.instances()
                    if conn.admin or info.get("tenant", LOCAL_TENANT) == conn.tenant]
        if conn.admin:
            server = dict(asdict(self.counters), connections=len(self.connections), instances=len(self.instances),
                          programs=len(self.store.hashes()))
        else:  # a tenant learns its own numbers, not how busy the others are
            server = {"connections": sum(c.tenant == conn.tenant for c in self.connections),
                      "instances": sum(r.tenant == conn.tenant for r in self.instances.records.values()),
                      "programs": self.store.count(conn.tenant)}
        host = self.host.stats()
        if not conn.admin and "levels" in host:  # per-tenant queues: a tenant sees its own row only
            host["levels"] = {k: dict(v, by_tenant={t: r for t, r in v["by_tenant"].items() if t == conn.tenant})
                              if isinstance(v, dict) else v for k, v in host["levels"].items()}
        return {"host": host, "server": server}

    def _describe(self, info: dict[str, Any]) -> dict[str, Any]:
        record = self.instances.get(info["id"])
        return dict(info, detached=bool(record and record.detached),
                    attached=bool(record and record.owner is not None))

    async def _upload(self, conn: Connection, req: p.UploadProgram) -> Any:
        try:
            if req.chunk_index == 0:
                self.discard_upload(conn)
                conn.upload = Upload(req.program_hash, req.total_chunks, self.config.max_program_bytes, self.uploads,
                                     conn.tenant)
            elif conn.upload is None:
                raise UploadError(f"out-of-order chunk: got chunk_index {req.chunk_index} with no upload "
                                  "in progress (start at chunk 0)")
            done = conn.upload.add(req.program_hash, req.chunk_index, req.total_chunks, req.chunk_data)
            if not done:
                return req.chunk_index
            data = conn.upload.finish()
        except UploadError as exc:
            self.discard_upload(conn)
            raise RequestError(f"upload_program: {exc}; upload discarded, restart at chunk 0") from exc
        conn.upload = None
        try:
            program_hash = await asyncio.to_thread(self.store.put, data, conn.tenant)
        except ProgramTooLarge as exc:
            raise RequestError(f"upload_program: {exc}") from exc
        except ProgramRejected as exc:
            raise RequestError(f"upload_program: program {req.program_hash} failed to compile: {exc}") from exc
        self.counters.uploads += 1
        return program_hash

    def discard_upload(self, conn: Connection) -> None:
        """Drop `conn`'s partial upload, if any (its bytes leave the server's upload budget)."""
        if conn.upload is not None:
            conn.upload.discard()
            conn.upload = None

    async def _launch(self, conn: Connection, req: p.LaunchInstance) -> str:
        if self.stopping:
            raise RequestError("launch_instance: the server is shutting down")
        if not self.store.visible(conn.tenant, req.program_hash, conn.admin):
            raise RequestError(f"launch_instance: unknown program {req.program_hash}; upload it first")
        self.store.touch(conn.tenant, req.program_hash)
        try:
            await asyncio.to_thread(self.store.ensure_compiled, req.program_hash)
        except KeyError as exc:
            raise RequestError(f"launch_instance: unknown program {req.program_hash}; upload it first") from exc
        except ProgramRejected as exc:
            raise RequestError(f"launch_instance: stored program no longer compiles: {exc}") from exc
        try:
            self.limits.take_instance(conn.tenant)
        except TenantLimitError as exc:
            raise RequestError(f"launch_instance: {exc}") from None
        record = InstanceRecord(program=req.program_hash, detached=req.detached, owner=conn, tenant=conn.tenant)
        on_event = self.instances.sink(record, asyncio.get_running_loop())
        try:
            extra: dict[str, Any] = {"priority": req.priority} if req.priority else {}
            if req.record:
                extra["record"] = True
            iid = self.host.launch(req.program_hash, list(req.arguments), on_event, tenant=conn.tenant, **extra)
        except BaseException as exc:
            self.limits.give_instance(conn.tenant)  # nothing was launched
            if isinstance(exc, KeyError):
                raise RequestError(f"launch_instance: host does not know program {req.program_hash}") from exc
            if isinstance(exc, HostBusy):
                raise RequestError(f"launch_instance: {exc}") from None
            raise
        record.id = iid
        # Events wait on the loop until this returns; a disconnect is handled after this request
        # finishes (same task), so `release` sees the instance.
        self.instances.add(record)
        self.counters.launched += 1
        return iid

    async def _signal(self, conn: Connection, req: p.SignalInstance) -> None:
        try:
            self._control(conn, "signal_instance", req.instance_id,
                          lambda: self.host.signal(req.instance_id, req.message))
        except InboxFull as exc:
            raise RequestError(f"signal_instance: {exc}") from None

    async def _close_input(self, conn: Connection, req: p.CloseInput) -> None:
        self._control(conn, "close_input", req.instance_id, lambda: self.host.close_input(req.instance_id))

    async def _terminate(self, conn: Connection, req: p.TerminateInstance) -> None:
        self._control(conn, "terminate_instance", req.instance_id,
                      lambda: self.host.terminate(req.instance_id, "terminated by request"))

    def _control(self, conn: Connection, kind: str, iid: str, action: Callable[[], None]) -> None:
        self.instances.owned(conn, kind, iid)
        try:
            action()
        except KeyError as exc:
            raise RequestError(f"{kind}: instance {iid} has finished") from exc

    async def _attach(self, conn: Connection, req: p.AttachInstance) -> None:
        record = self.instances.attach(conn, req.instance_id)
        if record is not None:
            # Buffered events go out after this request's response (queued right after we return).
            asyncio.get_running_loop().call_soon(self.instances.flush, record)


def _recording_record(record: Any) -> tuple[str, int]:
    """`query recording`'s record: an instance id (from the start), or {"instance_id", "offset"}."""
    if isinstance(record, str):
        return record, 0
    if isinstance(record, dict) and isinstance(record.get("instance_id"), str):
        offset = record.get("offset", 0)
        if isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0:
            return record["instance_id"], offset
    raise RequestError("query recording: record must be an instance id, or {\"instance_id\": id, \"offset\": "
                       f"bytes already read}}, got {repr(record)[:80]}")
