"""WIT interface `http` (0.5.0): outbound requests, served by host/net (allowlist, bounds, counters).

A request the host does not complete is the WIT error "KIND: message" (blocked, invalid, too-large,
timeout, busy, failed), never a trap: a guest can fall back. The calling instance waits for the
response with its run-gate slot given up, as for a forward; terminating it ends the wait (the
request runs out on the pool, its answer dropped). One instance has one request in flight at a time
(its thread waits for it); a tenant's instances together at most `HttpLimits.per_tenant`.
"""

from __future__ import annotations

from typing import Any

from wasmtime.component import Record

from host.api.guest import GuestError, Import, guest_import
from host.net.client import FetchError, HttpService
from host.wasm.instance import Instance


def imports(service: HttpService) -> dict[str, Import]:
    @guest_import("http.fetch")
    def fetch(inst: Instance, req: Any) -> Record | str:
        try:
            method, url, headers = req.method, req.url, req.headers
            body, timeout_ms = req.body, getattr(req, "timeout-ms")
        except AttributeError as e:
            raise GuestError(f"malformed request record: {e}") from None
        try:
            fut = service.submit(inst.pages.tenant, method, url, [(k, v) for k, v in headers], bytes(body),
                                 timeout_ms)
        except FetchError as e:
            return str(e)  # the result's error case
        fut.add_done_callback(lambda _f: inst.wake())
        inst.wait_until(fut.done)
        try:
            reply = fut.result()
        except FetchError as e:
            return str(e)
        out = Record()
        out.__dict__.update({"status": reply.status, "headers": reply.headers, "body": reply.body})
        return out

    return {"fetch": fetch}
