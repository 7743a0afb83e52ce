"""What the server is given: its network and protocol settings, and the host methods it may call."""

from __future__ import annotations

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
    auth_token: str | None = None
    data_dir: Path = field(default_factory=default_data_dir)
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_program_bytes: int = DEFAULT_MAX_PROGRAM_BYTES
    # Events kept for a detached instance while no connection is attached; older ones are dropped.
    event_buffer_limit: int = 10_000
    # Frames queued for a client that does not read; past this the connection is dropped.
    max_queued_frames: int = 65_536


class HostFacade(Protocol):
    """The `Host` methods the server calls, and no others (`host.Host` implements them).

    `launch`, `signal`, `close_input` and `terminate` raise KeyError for an unknown program or an
    instance that has ended; `on_event` is called on the instance's thread, its last call with a
    terminal event.
    """

    def compile(self, wasm: bytes) -> str: ...

    def launch(self, program_hash: str, args: list[str], on_event: Callable[[InstanceEvent], None]) -> str: ...

    def signal(self, instance_id: str, message: str) -> None: ...

    def close_input(self, instance_id: str) -> None: ...

    def terminate(self, instance_id: str, reason: str = ...) -> None: ...

    def instances(self) -> list[dict[str, Any]]: ...

    def stats(self) -> dict[str, Any]: ...

    def model_names(self) -> list[str]: ...
