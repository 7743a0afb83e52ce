"""The bounds on inferlets' outbound HTTP (light: HostConfig imports it; the client is host/net/client.py)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HttpLimits"]


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on inferlets' outbound HTTP (HostConfig.http_limits; pie-serve --http-*)."""

    max_request_bytes: int = 1 << 20
    max_response_bytes: int = 8 << 20
    timeout_s: float = 30.0  # the whole exchange, redirects included (a guest may ask for less)
    per_tenant: int = 32  # requests in flight for one tenant's instances together
    max_redirects: int = 5

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_response_bytes", "timeout_s", "per_tenant"):
            if not getattr(self, name) > 0:
                raise ValueError(f"http limit {name} must be > 0, got {getattr(self, name)!r}")
        if not 0 <= self.max_redirects <= 20:
            raise ValueError(f"http limit max_redirects must be in [0, 20], got {self.max_redirects!r}")
