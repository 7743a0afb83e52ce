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
from host.server.programs import DEFAULT_MAX_PROGRAM_BYTES

__all__ = ["ServerConfig", "HostFacade"]


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
    # Frames queued for a client that does not read; past this the connection is dropped.
    max_queued_frames: int = 65_536

    def __post_init__(self) -> None:
        names = [n for n, _ in self.tenants]
        tokens = [t for _, t in self.tenants] + ([self.auth_token] if self.auth_token else [])
        if len(set(names)) != len(names) or "default" in names or "local" in names:
            raise ValueError(f"tenant names must be distinct and not 'default' or 'local', got {names}")
        if len(set(tokens)) != len(tokens) or not all(tokens):
            raise ValueError("every tenant needs its own non-empty token")

    @property
    def requires_auth(self) -> bool:
        return self.auth_token is not None or bool(self.tenants)

    def tenant_for(self, token: str) -> str | None:
        """The tenant a token authenticates, None if it matches none (compared in constant time)."""
        found = None
        for name, expected in ((("default", self.auth_token),) if self.auth_token else ()) + self.tenants:
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
               tenant: str = ...) -> str: ...

    def signal(self, instance_id: str, message: str) -> None: ...

    def close_input(self, instance_id: str) -> None: ...

    def terminate(self, instance_id: str, reason: str = ...) -> None: ...

    def instances(self) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...

    def model_names(self) -> list[str]: ...
