"""The dashboard (issue 54): a live page over the host's numbers, on the server's own port.

Routes: `GET /dashboard` (one self-contained page, static/dashboard.html: inline CSS and vanilla
JS, no build step), `GET /dashboard/events` (SSE: one JSON snapshot a second), `GET
/dashboard/snapshot` (the same JSON once) and `GET /dashboard/logs?id=` (an instance's recent log
lines, where the host keeps them: running instances, and those that ended up to the host's log
retention ago, listed as `ended`). docs/observability.md says what each panel shows.

Auth as the rest of the server: a token as `Authorization: Bearer` or `?token=` (EventSource
cannot send headers); no token configured, everyone sees everything; a bad or missing one is
answered 401. The page itself holds no data and is served to anyone. Invariant: a tenant's
snapshot holds its own instances (running and ended) and its own per-tenant row only; the host-wide gauges (batches,
KV pages, launch queue, prefix cache) are what the `stats` query shows every tenant already. The
admin (`--auth-token`) sees every tenant, and the workers, outbound HTTP and server summaries.

Bounds: at most `MAX_STREAMS` event streams at once, each counted as a connection of its tenant
(`TenantLimits`), each dropped when it takes longer than `write_timeout_s` to take an event; one
collection a second serves every open stream (`_collect`; a /dashboard/snapshot request collects
afresh).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from host.server.config import LOCAL_TENANT, HostFacade, ServerConfig
from host.server.http import GuardedStream
from host.server.sse import sse_event
from host.server.tenants import TenantLimitError, TenantLimits

__all__ = ["Dashboard", "MAX_STREAMS", "INTERVAL_S"]

INTERVAL_S = 1.0  # between two snapshots of a stream
MAX_STREAMS = 64  # event streams open at once, all tenants together
MAX_LOG_LINES = 200  # the most recent lines /dashboard/logs returns
MAX_ENDED = 100  # ended instances a snapshot lists (the viewer's newest)
_ENDED_COLLECTED = 1024  # asked of the host: a tenant's newest 100 are among them (Host keeps 1024)
_FRESH_S = 0.5  # a collection this recent serves another stream's tick
_PAGE_HEADERS = {
    "cache-control": "no-store", "referrer-policy": "no-referrer", "x-content-type-options": "nosniff",
    # the page loads nothing from elsewhere and runs only its own inline script
    "content-security-policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                               "connect-src 'self'; img-src data:; frame-ancestors 'none'",
}


class Dashboard:
    """The dashboard's routes over `host`, with `config`'s tokens and `limits`' per-tenant caps."""

    def __init__(self, host: HostFacade, config: ServerConfig, limits: TenantLimits) -> None:
        self.host = host
        self.config = config
        self.limits = limits
        self.streams = 0  # event streams open now
        self._closing = asyncio.Event()
        self._refresh = asyncio.Lock()
        self._last: tuple[float, dict[str, Any]] | None = None  # (monotonic time, full snapshot)
        self._page: bytes | None = None

    def routes(self) -> list[BaseRoute]:
        return [Route("/dashboard", self._page_route), Route("/dashboard/events", self._events),
                Route("/dashboard/snapshot", self._snapshot), Route("/dashboard/logs", self._logs)]

    def close(self) -> None:
        """End every open event stream (the server is stopping)."""
        self._closing.set()

    # ---- auth ---------------------------------------------------------------------------------

    def _tenant(self, request: Request) -> str | None:
        """The tenant of the request's token ("local" when the server has none); None if refused."""
        if not self.config.requires_auth:
            return LOCAL_TENANT
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        token = key.strip() if scheme.lower() == "bearer" else request.query_params.get("token", "")
        return self.config.tenant_for(token) if token else None

    @staticmethod
    def _refused() -> Response:
        return PlainTextResponse("invalid or missing token: pass it as 'Authorization: Bearer <token>' or "
                                 "?token=<token>", 401, headers={"www-authenticate": "Bearer"})

    # ---- routes -------------------------------------------------------------------------------

    async def _page_route(self, request: Request) -> Response:
        if self._page is None:
            self._page = resources.files("host.server").joinpath("static/dashboard.html").read_bytes()
        return Response(self._page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    async def _snapshot(self, request: Request) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return self._refused()
        snapshot = self.view(await self._collect(max_age_s=0.0), tenant)  # afresh, as a /metrics scrape
        return JSONResponse(snapshot, headers={"cache-control": "no-store"})

    async def _events(self, request: Request) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return self._refused()
        if self._closing.is_set():
            return PlainTextResponse("the server is shutting down", 503)
        if self.streams >= MAX_STREAMS:
            return PlainTextResponse(f"the dashboard has its maximum of {MAX_STREAMS} viewers open; "
                                     "try again when one has closed", 503)
        try:
            self.limits.take_connection(tenant)
        except TenantLimitError as e:
            return PlainTextResponse(str(e), 429)
        self.streams += 1
        released = False

        def release() -> None:  # GuardedStream may call it twice (a write timeout, then its end)
            nonlocal released
            if not released:
                released = True
                self.streams -= 1
                self.limits.give_connection(tenant)

        response = GuardedStream(self._stream(tenant), self.config.write_timeout_s, release)
        response.headers["cache-control"] = "no-store"
        response.headers["x-accel-buffering"] = "no"  # a proxy in front must not hold the events back
        return response

    async def _stream(self, tenant: str) -> AsyncIterator[bytes]:
        yield b"retry: 2000\n\n"  # EventSource reconnects after 2 s when the stream breaks
        while not self._closing.is_set():
            yield sse_event(self.view(await self._collect(), tenant))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), INTERVAL_S)

    async def _logs(self, request: Request) -> Response:
        tenant = self._tenant(request)
        if tenant is None:
            return self._refused()
        logs = getattr(self.host, "logs", None)
        if logs is None:
            return PlainTextResponse("this host keeps no instance logs", 404)
        iid = request.query_params.get("id", "")
        # (`Host.logs` answers None for another tenant's instance: as unknown as one that never was)
        lines = await asyncio.to_thread(logs, iid, None if self.config.is_admin(tenant) else tenant)
        if lines is None:
            return PlainTextResponse(f"unknown instance {iid[:80]!r} (or its log has expired)", 404)
        return JSONResponse({"id": iid, "lines": list(lines)[-MAX_LOG_LINES:]}, headers={"cache-control": "no-store"})

    # ---- snapshots ----------------------------------------------------------------------------

    async def _collect(self, max_age_s: float = _FRESH_S) -> dict[str, Any]:
        """Every tenant's numbers, at most `max_age_s` old: the streams' ticks share one collection;
        on a thread (the host's locks are not the event loop's to wait on)."""
        async with self._refresh:
            now = time.monotonic()
            if self._last is None or now - self._last[0] >= max_age_s:
                ended_fn = getattr(self.host, "ended_instances", None)  # (a host that keeps logs)
                stats, instances, ended = await asyncio.to_thread(lambda: (
                    self.host.stats(), self.host.instances(), ended_fn(_ENDED_COLLECTED) if ended_fn else []))
                self._last = (now, full_snapshot(stats, instances, dict(self.limits.connections), self.streams,
                                                 logs=getattr(self.host, "logs", None) is not None, ended=ended))
            return self._last[1]

    def view(self, full: dict[str, Any], tenant: str) -> dict[str, Any]:
        """`full` as `tenant` may see it: the admin (or a server without tokens) all of it, another
        tenant its own instances and row, and the host-wide gauges."""
        if self.config.is_admin(tenant):
            return dict(full, ended=full["ended"][:MAX_ENDED], viewer={"tenant": tenant, "admin": True})
        hidden = ("workers", "http", "children", "server")
        out = {k: v for k, v in full.items() if k not in hidden}
        out["instances"] = [i for i in full["instances"] if i["tenant"] == tenant]
        out["ended"] = [i for i in full["ended"] if i["tenant"] == tenant][:MAX_ENDED]
        out["tenants"] = {tenant: full["tenants"].get(tenant, _tenant_row())}
        out["viewer"] = {"tenant": tenant, "admin": False}
        return out


def _tenant_row() -> dict[str, float]:
    return {"running": 0, "queued": 0, "pages": 0, "tokens": 0, "connections": 0, "forward_wait_ms": 0.0}


def full_snapshot(stats: dict[str, Any], instances: list[dict[str, Any]], connections: dict[str, int],
                  streams: int, logs: bool = False, ended: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One snapshot of everything from `Host.stats()`, `Host.instances()`, `Host.ended_instances()`
    (`ended`: whose logs are still kept) and the server's connections per tenant; keys a host does
    not report read as 0."""
    now = time.time()
    sched = stats.get("scheduler", {})
    memory = stats.get("memory", {})
    cache = stats.get("prefix_cache", {"mode": "off"})
    lookups, hits = cache.get("lookups", 0), cache.get("hits", 0)
    free, total = stats.get("free_pages", 0), stats.get("total_pages", 0)
    rows = [{"id": i["id"], "program": str(i.get("program", ""))[:12], "tenant": i.get("tenant", LOCAL_TENANT),
             "state": i.get("state", "running"), "age_s": round(max(0.0, now - i.get("started_at", now)), 1),
             "priority": i.get("priority", 0), "pages": i.get("pages", 0), "tokens": i.get("tokens", 0),
             "swapped": i.get("swapped", 0)} for i in instances]
    rows.sort(key=lambda r: -r["age_s"])
    gone = [{"id": i["id"], "program": str(i.get("program", ""))[:12], "tenant": i.get("tenant", LOCAL_TENANT),
             "state": i.get("state", ""), "ended_s": round(max(0.0, now - i.get("ended_at", now)), 1),
             "ran_s": round(max(0.0, i.get("ended_at", now) - i.get("started_at", now)), 1),
             "log_lines": i.get("log_lines", 0)} for i in ended or []]
    tenants: dict[str, dict[str, float]] = {}
    for r in rows:
        t = tenants.setdefault(r["tenant"], _tenant_row())
        t["queued" if r["state"] == "queued" else "running"] += 1
        t["pages"] += r["pages"]
        t["tokens"] += r["tokens"]
    for name, n in connections.items():
        tenants.setdefault(name, _tenant_row())["connections"] = n
    for name, row in stats.get("levels", {}).get("forwards", {}).get("by_tenant", {}).items():
        tenants.setdefault(name, _tenant_row())["forward_wait_ms"] = round(1000 * row.get("wait_s_mean", 0.0), 2)
    lq = stats.get("launch_queue", {})
    return {
        "time": now, "interval_s": INTERVAL_S, "model": stats.get("model", ""), "logs": logs,
        "instances": rows, "ended": gone,
        "scheduler": {k: sched.get(k, 0) for k in ("batches", "forwards", "tokens", "max_batch_size")},
        "kv": {"total": total, "free": free, "used": total - free, "suspended": memory.get("suspended", 0),
               "swapped_pages": sum(r["swapped"] for r in rows), "swap_used_bytes": memory.get("swap_used_bytes", 0),
               "waiting": memory.get("waiting", 0), "suspensions": memory.get("suspensions", 0)},
        "launch_queue": {k: lq.get(k, 0) for k in ("queued", "limit", "timeouts", "queued_total")},
        "prefix_cache": {"mode": cache.get("mode", "off"), "lookups": lookups, "hits": hits,
                         "hit_rate": hits / lookups if lookups else None,
                         "tokens_saved": cache.get("tokens_saved", 0)},
        "tenants": dict(sorted(tenants.items())),
        "workers": {k: v for k, v in stats.get("workers", {}).items() if k != "per_worker"},
        "http": stats.get("http", {}), "children": stats.get("children", {}),
        "server": {"dashboards": streams, "connections": sum(connections.values())},
    }
