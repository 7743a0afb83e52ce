"""The Python host: runs WebAssembly inferlets and batches their forwards into one backend.

The embedding API (docs/embedding.md)::

    from host import Host, HostConfig
    with Host(HostConfig()) as host:            # or Host(config, backend=any Backend)
        program = host.compile(wasm_bytes)
        iid = host.launch(program, ["--prompt", "hi"], on_event=print)
        host.wait(iid)

Importing `host` (or `host.client`) loads nothing heavy: `Host` and friends are imported on
first use, so a client-only process never loads torch, wasmtime, tiktoken or jinja2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Host", "HostBusy", "InboxFull", "HostConfig", "InstanceEvent", "TERMINAL_EVENTS", "CompileError", "Backend"]

_LAZY = {
    "Host": "host.host",
    "HostBusy": "host.host",
    "InboxFull": "host.wasm.inbox",
    "HostConfig": "host.config",
    "InstanceEvent": "host.events",
    "TERMINAL_EVENTS": "host.events",
    "CompileError": "host.wasm.engine",
    "Backend": "gpu_backend.types",
}

if TYPE_CHECKING:
    from gpu_backend.types import Backend
    from host.config import HostConfig
    from host.events import TERMINAL_EVENTS, InstanceEvent
    from host.host import Host, HostBusy
    from host.wasm.engine import CompileError
    from host.wasm.inbox import InboxFull


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'host' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
