"""The HTTP client behind the `http.fetch` import: the operator's allowlist, bounds and counters.

Every hop of a request (the first and each redirect) is checked by `HttpPolicy` (policy.py) and
sent to the address the check resolved and allowed, with the URL's host in the Host header and as
the TLS server name (certificates are verified against it): a name cannot resolve to one address
for the check and another for the connection. Redirects are followed here, at most `max_redirects`,
never by httpx. The request body, the response body (read in pieces, stopped past the bound), the
time of the whole exchange and the requests in flight per tenant are bounded (`HttpLimits`,
`pie-serve --http-*`). Requests run on a thread pool; the calling instance waits with its run-gate
slot given up (host/api/http.py).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from host.net.limits import HttpLimits
from host.net.policy import Blocked, HttpPolicy

__all__ = ["FetchError", "HttpLimits", "HttpService", "Reply", "METHODS"]

METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})
# headers the host sets itself (Host: the checked URL's) or that belong to one connection
_DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "upgrade",
                      "proxy-connection", "te", "trailer"})
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class FetchError(Exception):
    """A request the host did not complete; str(e) is "KIND: message" (the WIT error string)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind


@dataclass(frozen=True)
class Reply:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


class HttpService:
    """Outbound HTTP for every instance of a host: who may reach what, and the counters."""

    def __init__(self, allow: Sequence[str] = (), tenant_allow: Mapping[str, Sequence[str]] | None = None,
                 limits: HttpLimits | None = None,
                 resolver: Callable[[str, int], list[str]] | None = None) -> None:
        self.allow = tuple(allow)
        self.tenant_allow = {t: tuple(p) for t, p in (tenant_allow or {}).items()}
        self.limits = limits or HttpLimits()
        self._resolver = resolver
        # parsed now, so a bad pattern fails the host's start with the parser's message
        self._policies = {t: HttpPolicy(self.allow + extra, resolver) for t, extra in self.tenant_allow.items()}
        self._default = HttpPolicy(self.allow, resolver)
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()  # per tenant
        self.counts: Counter[str] = Counter()  # outcome -> requests: ok, blocked, invalid, too-large, ...
        self.bytes_sent = 0
        self.bytes_received = 0
        self._pool: ThreadPoolExecutor | None = None
        self._client: httpx.Client | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.allow) or any(self.tenant_allow.values())

    def policy(self, tenant: str) -> HttpPolicy:
        return self._policies.get(tenant, self._default)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.counts), "in_flight": sum(self._in_flight.values()),
                    "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received}

    def submit(self, tenant: str, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
               timeout_ms: int | None) -> Future[Reply]:
        """Check what can be checked at once (raising FetchError) and start the request; its future
        holds the Reply or a FetchError. The tenant's slot is freed when the future is done."""
        try:
            deadline = self._validate(method, url, headers, body, timeout_ms)
            if not self.policy(tenant).allows_anything:
                raise FetchError("blocked", "outbound HTTP is off for this tenant: the operator allows hosts with "
                                            "--http-allow HOST[:PORT]")
            with self._lock:
                if self._in_flight[tenant] >= self.limits.per_tenant:
                    raise FetchError("busy", f"this tenant has {self.limits.per_tenant} HTTP requests in flight "
                                             "(--http-max-per-tenant); try again when one has finished")
                self._in_flight[tenant] += 1
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="pie-http")
                pool = self._pool
        except FetchError as e:
            self._count(e.kind)
            raise
        fut = pool.submit(self._run, tenant, method.upper(), url, headers, body, deadline)
        fut.add_done_callback(lambda _f: self._release(tenant))
        return fut

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
            client, self._client = self._client, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    # ---- internals ----
    def _validate(self, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
                  timeout_ms: int | None) -> float:
        if method.upper() not in METHODS:
            raise FetchError("invalid", f"method {method[:32]!r} is not one of {', '.join(sorted(METHODS))}")
        if len(url) > 8192:
            raise FetchError("invalid", f"a URL of {len(url)} characters is longer than 8192")
        if len(body) > self.limits.max_request_bytes:
            raise FetchError("too-large", f"a request body of {len(body)} bytes is over the host's "
                                          f"{self.limits.max_request_bytes}-byte bound (--http-max-request-kb)")
        if len(headers) > 100 or sum(len(k) + len(v) for k, v in headers) > 65536:
            raise FetchError("invalid", "more than 100 headers or 64 KiB of them")
        for k, v in headers:
            if not k or any(c in k for c in " \t\r\n:\0") or any(c in v for c in "\r\n\0"):
                raise FetchError("invalid", f"malformed header {k[:64]!r}")
        wait_s = self.limits.timeout_s if timeout_ms is None else min(timeout_ms / 1000, self.limits.timeout_s)
        return time.monotonic() + wait_s

    def _release(self, tenant: str) -> None:
        with self._lock:
            self._in_flight[tenant] -= 1
            if self._in_flight[tenant] <= 0:
                del self._in_flight[tenant]

    def _count(self, outcome: str, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.counts[outcome] += 1
            self.bytes_sent += sent
            self.bytes_received += received

    def _http(self) -> httpx.Client:
        with self._lock:
            if self._client is None:
                # no environment proxies or .netrc: a proxy would connect to what we did not check
                self._client = httpx.Client(trust_env=False, follow_redirects=False,
                                            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32))
            return self._client

    def _run(self, tenant: str, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
             deadline: float) -> Reply:
        sent = received = 0
        try:
            reply, sent, received = self._exchange(tenant, method, url, headers, body, deadline)
        except FetchError as e:
            self._count(e.kind, sent, received)
            raise
        self._count("ok", sent, received)
        return reply

    def _exchange(self, tenant: str, method: str, url: str, headers: list[tuple[str, str]], body: bytes,
                  deadline: float) -> tuple[Reply, int, int]:
        policy, client = self.policy(tenant), self._http()
        headers = [(k, v) for k, v in headers if k.lower() not in _DROPPED]
        sent = 0
        for hop in range(self.limits.max_redirects + 1):
            try:
                target = policy.check(url)
            except Blocked as e:
                raise FetchError("blocked", str(e).removeprefix("blocked: ")) from None
            left = deadline - time.monotonic()
            if left <= 0:
                raise FetchError("timeout", f"no response within the request's time ({url[:200]})")
            host = target.host if ":" not in target.host else f"[{target.host}]"
            default = {"http": 80, "https": 443}[target.scheme]
            req = client.build_request(
                method, target.url, headers=[("Host", host if target.port == default else f"{host}:{target.port}"),
                                             *headers], content=body or None,
                extensions={"sni_hostname": target.host, "timeout": httpx.Timeout(left).as_dict()})
            sent += len(body)
            try:
                resp = client.send(req, stream=True)
            except httpx.TimeoutException:
                raise FetchError("timeout", f"no response within the request's time ({url[:200]})") from None
            except (httpx.HTTPError, OSError, ValueError) as e:
                raise FetchError("failed", f"{type(e).__name__}: {e}"[:500]) from None
            try:
                location = resp.headers.get("location")
                if resp.status_code in _REDIRECTS and location is not None:
                    if hop == self.limits.max_redirects:
                        raise FetchError("failed", f"more than {self.limits.max_redirects} redirects")
                    nxt = urljoin(url, location)
                    if urlsplit(nxt)[:2] != urlsplit(url)[:2]:  # another origin: no credentials
                        headers = [(k, v) for k, v in headers if k.lower() not in ("authorization", "cookie")]
                    if resp.status_code == 303 or (resp.status_code in (301, 302) and method == "POST"):
                        method, body = ("HEAD" if method == "HEAD" else "GET"), b""
                        headers = [(k, v) for k, v in headers if k.lower() != "content-type"]
                    url = nxt
                    continue
                data = self._read(resp, deadline, url)
                return Reply(resp.status_code, list(resp.headers.multi_items()), data), sent, len(data)
            finally:
                resp.close()
        raise AssertionError("unreachable")

    def _read(self, resp: httpx.Response, deadline: float, url: str) -> bytes:
        cap = self.limits.max_response_bytes
        declared = resp.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise FetchError("too-large", f"the response is {declared} bytes, over the host's {cap}-byte bound "
                                          "(--http-max-response-kb)")
        parts: list[bytes] = []
        size = 0
        try:
            for chunk in resp.iter_bytes():
                size += len(chunk)
                if size > cap:
                    raise FetchError("too-large", f"the response is over the host's {cap}-byte bound "
                                                  "(--http-max-response-kb)")
                if time.monotonic() > deadline:
                    raise FetchError("timeout", f"the response did not end within the request's time ({url[:200]})")
                parts.append(chunk)
        except httpx.TimeoutException:
            raise FetchError("timeout", f"the response did not end within the request's time ({url[:200]})") from None
        except httpx.HTTPError as e:
            raise FetchError("failed", f"{type(e).__name__}: {e}"[:500]) from None
        return b"".join(parts)
