"""What the server is given: its network and protocol settings, and the host methods it may call."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from host.client.protocol import MAX_FRAME_BYTES
from host.config import default_data_dir
from host.events import InstanceEvent
from host.server.programs import (
    DEFAULT_MAX_PROGRAM_BYTES,
    DEFAULT_PROGRAM_TTL_S,
    DEFAULT_STORE_BYTES_PER_TENANT,
    DEFAULT_UPLOAD_BYTES_IN_FLIGHT,
    TENANT_NAME_RE,
)

__all__ = ["ServerConfig", "HostFacade", "ADMIN_TENANT", "LOCAL_TENANT"]

MIB = 2**20
ADMIN_TENANT = "default"  # the identity of --auth-token: sees every tenant's instances and programs
LOCAL_TENANT = "local"  # every client of a server without tokens


@dataclass(frozen=True)
class ServerConfig:
    """Network and protocol settings; the host's own settings live in `HostConfig`."""

    host: str = "127.0.0.1"
    port: int = 8080
    auth_token: str | None = None  # its clients act as tenant "default"
    # More tokens, one per tenant: (tenant name, token). A tenant's instances see only its own
    # KV exports. With no token at all every client is tenant "local".
    tenants: tuple[tuple[str, str], ...] = ()
    data_dir: Path = field(default_factory=default_data_dir)
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_program_bytes: int = DEFAULT_MAX_PROGRAM_BYTES
    # Events kept for a detached instance while no connection is attached; older ones are dropped.
    event_buffer_limit: int = 10_000
    # Frames / bytes queued for a client that does not read; past either the connection is dropped.
    max_queued_frames: int = 65_536
    max_queued_bytes: int = 16 * MIB
    # Bytes all partial uploads of the server hold at once (one per connection, each at most
    # max_program_bytes); a chunk past it is refused.
    max_upload_bytes_in_flight: int = DEFAULT_UPLOAD_BYTES_IN_FLIGHT
    max_body_bytes: int = 8 * MIB  # an HTTP request body; larger is answered 413 unread
    max_connections: int = 1024  # open connections (WebSocket and HTTP) of the server
    # WebSocket connections / HTTP requests in progress per tenant; a server with one identity has
    # only max_connections (see `tenant_connection_cap`)
    max_connections_per_tenant: int = 256
    auth_timeout_s: float = 10.0  # a WebSocket connection that has not authenticated by then is closed
    read_timeout_s: float = 30.0  # to send an HTTP request's headers, and between pieces of its body
    write_timeout_s: float = 30.0  # a client that takes longer to take one SSE event is dropped
    max_store_bytes_per_tenant: int = DEFAULT_STORE_BYTES_PER_TENANT
    program_ttl_s: float = DEFAULT_PROGRAM_TTL_S  # a program nobody launched for this long is evicted
    # running at once, WebSocket and HTTP together; None = no cap (pie-serve's default: half of
    # --max-instances when the server has more than one identity)
    max_instances_per_tenant: int | None = None
    # /v1/responses: responses kept in memory for previous_response_id, and for how long (oldest dropped first)
    responses_max_stored: int = 1024
    responses_ttl_s: float = 3600.0
    # chat's image parts (host/server/openai_images.py): one image's bytes, images per request, and the
    # hosts image URLs may be fetched from (HttpPolicy patterns, "*": any global address; empty: refused)
    max_image_bytes: int = 20 * MIB  # one image's encoded bytes (the host takes at most 20 MiB: openai_images.py)
    max_images: int = 8
    allow_remote_images: tuple[str, ...] = ()
    # /v1/embeddings `dimensions`: the operator's word that the model was trained for Matryoshka
    # embeddings, () any width, else those widths; None: what its config.json says (is_matryoshka /
    # matryoshka_dimensions; neither: its full width only)
    matryoshka: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        names = [n for n, _ in self.tenants]
        tokens = [t for _, t in self.tenants] + ([self.auth_token] if self.auth_token else [])
        if len(set(names)) != len(names) or "default" in names or "local" in names:
            raise ValueError(f"tenant names must be distinct and not 'default' or 'local', got {names}")
        if len(set(tokens)) != len(tokens) or not all(tokens):
            raise ValueError("every tenant needs its own non-empty token")
        bad = [n for n in names if TENANT_NAME_RE.fullmatch(n) is None]
        if bad:
            raise ValueError(f"tenant names are 1-64 letters, digits, '_', '.' or '-' (not starting with "
                             f"'.' or '-'), got {bad}")
        positive = {k: getattr(self, k) for k in (
            "max_frame_bytes", "max_program_bytes", "max_queued_frames", "max_queued_bytes",
            "max_upload_bytes_in_flight", "max_body_bytes", "max_connections", "max_connections_per_tenant",
            "auth_timeout_s", "read_timeout_s", "write_timeout_s", "max_store_bytes_per_tenant", "program_ttl_s",
            "responses_max_stored", "responses_ttl_s", "max_image_bytes", "max_images")}
        if self.max_instances_per_tenant is not None:
            positive["max_instances_per_tenant"] = self.max_instances_per_tenant
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.matryoshka is not None and not all(d > 0 for d in self.matryoshka):
            raise ValueError(f"matryoshka widths must be > 0, got {list(self.matryoshka)}")

    @property
    def requires_auth(self) -> bool:
        return self.auth_token is not None or bool(self.tenants)

    @property
    def identities(self) -> int:
        """How many tenants can connect: one per token, or the one `local` without tokens."""
        return max(1, (1 if self.auth_token else 0) + len(self.tenants))

    @property
    def tenant_connection_cap(self) -> int:
        """Connections one tenant may have open: `max_connections_per_tenant`, unless the server
        has one identity (then there is nobody to share with: `max_connections`)."""
        return self.max_connections_per_tenant if self.identities > 1 else self.max_connections

    def is_admin(self, tenant: str) -> bool:
        """Whether `tenant` sees and acts on every tenant's instances and programs: the `--auth-token`
        identity, and everyone on a server without tokens (they are all one tenant there)."""
        return tenant == ADMIN_TENANT or not self.requires_auth

    def tenant_for(self, token: str) -> str | None:
        """The tenant a token authenticates, None if it matches none (compared in constant time)."""
        found = None
        for name, expected in (((ADMIN_TENANT, self.auth_token),) if self.auth_token else ()) + self.tenants:
            if hmac.compare_digest(token.encode(), expected.encode()):
                found = name
        return found


class HostFacade(Protocol):
    """The `Host` methods the server calls, and no others (`host.Host` implements them).

    `launch`, `signal`, `close_input` and `terminate` raise KeyError for an unknown program or an
    instance that has ended; `on_event` is called on the instance's thread, its last call with a
    terminal event.
    """

    def compile(self, wasm: bytes) -> str: ...

    def launch(self, program_hash: str, args: list[str], on_event: Callable[[InstanceEvent], None],
               tenant: str = ..., priority: int = ..., record: bool = ...) -> str: ...

    def signal(self, instance_id: str, message: str) -> None: ...

    def close_input(self, instance_id: str) -> None: ...

    def terminate(self, instance_id: str, reason: str = ...) -> None: ...

    def instances(self) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...

    def model_names(self) -> list[str]: ...

    def recording(self, instance_id: str, tenant: str | None = ...) -> bytes | None: ...
