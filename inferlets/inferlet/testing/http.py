"""The fake host's `http` interface (WIT 0.5.0): requests answered by a function the test gives.

    host = FakeHost(http=lambda method, url, headers, body: (200, [("content-type", "text/plain")], b"hi"))

A handler may raise `FakeHttpError("blocked: ...")` to answer with the error case; with no handler every
request is blocked, as on a host whose operator allows no host.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from inferlet._host import Err

__all__ = ["FakeHttp", "FakeHttpError", "Handler"]

Handler = Callable[[str, str, list[tuple[str, str]], bytes], tuple[int, list[tuple[str, str]], bytes]]


class FakeHttpError(Exception):
    """Raised by a handler: the request's error result ("KIND: message")."""


@dataclass
class Request:
    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes
    timeout_ms: int | None


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class FakeHttp:
    handler: Handler | None = None
    requests: list[Request] = field(default_factory=list)  # every request made, in order
    Request = Request  # (the bindings' record class, as `_host.http.Request`)

    def fetch(self, req: Request) -> Response:
        self.requests.append(req)
        if self.handler is None:
            raise Err("blocked: outbound HTTP is off on this server: the operator allows hosts with --http-allow")
        try:
            status, headers, body = self.handler(req.method, req.url, list(req.headers), bytes(req.body))
        except FakeHttpError as e:
            raise Err(str(e)) from None
        return Response(status, headers, body)
