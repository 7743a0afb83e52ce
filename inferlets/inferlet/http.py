"""Outbound HTTP from an inferlet (WIT 0.5.0, interface `http`): off unless the operator allows it.

    from inferlet import http

    r = http.fetch("https://api.example.com/v1/weather?city=Paris")
    if r.status == 200:
        weather = r.json()

The host sends the request only to hosts its operator listed (`pie-serve --http-allow HOST[:PORT]`),
never to a loopback, private, link-local or metadata address unless one is listed by address,
checked after DNS resolution and on every redirect. Whatever stops a request (not allowed, too
large, too slow, too many at once, the server unreachable) raises `HttpError`, with its `kind`;
a status such as 404 or 500 is a response, not an error.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inferlet import _host

__all__ = ["HttpError", "Response", "fetch", "get", "post_json", "KINDS"]

# What an error string from the host starts with ("blocked: ..."), and HttpError.kind.
KINDS = ("blocked", "invalid", "too-large", "timeout", "busy", "failed")

Headers = Mapping[str, str] | Iterable[tuple[str, str]]


class HttpError(Exception):
    """The host did not complete the request. `kind`: "blocked" (the allowlist or the address rules
    refused it), "invalid" (a malformed request), "too-large" (request or response past the host's
    bound), "timeout", "busy" (too many requests in flight for this instance or tenant) or "failed"
    (the connection failed)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        kind, sep, _ = message.partition(":")
        self.kind = kind if sep and kind in KINDS else "failed"


@dataclass(frozen=True)
class Response:
    status: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The first header of this name (case-insensitive), or None."""
        name = name.lower()
        return next((v for k, v in self.headers if k.lower() == name), None)

    def text(self) -> str:
        return self.body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


def fetch(url: str, method: str = "GET", headers: Headers | None = None, body: bytes | str | None = None,
          timeout_ms: int | None = None) -> Response:
    """Send a request and return the whole response (redirects followed, each hop checked by the
    host). Raises HttpError when the host does not complete it."""
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers or ())
    data = body.encode() if isinstance(body, str) else (body or b"")
    req = _host.http.Request(method=method.upper(), url=url, headers=[(str(k), str(v)) for k, v in pairs],
                             body=data, timeout_ms=timeout_ms)
    try:
        got = _host.http.fetch(req)
    except _host.Err as e:
        raise HttpError(str(e.value)) from None
    return Response(status=got.status, headers=[(k, v) for k, v in got.headers], body=bytes(got.body))


def get(url: str, headers: Headers | None = None, timeout_ms: int | None = None) -> Response:
    return fetch(url, "GET", headers, None, timeout_ms)


def post_json(url: str, payload: Any, headers: Headers | None = None, timeout_ms: int | None = None) -> Response:
    """POST `payload` as JSON (Content-Type: application/json)."""
    pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers or ())
    return fetch(url, "POST", [("content-type", "application/json"), *pairs], json.dumps(payload), timeout_ms)
