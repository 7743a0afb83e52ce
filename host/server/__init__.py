"""The server layer: protocol v1 over WebSocket in front of one host (`pie-serve`).

`Server` (server.py) accepts connections and routes frames; `RequestHandlers` (handlers.py)
answers each request; `InstanceTable` (instances.py) tracks which connection owns which
instance and buffers detached ones' events; `ProgramStore` (programs.py) keeps uploaded
components on disk. The server reaches the host only through `HostFacade` (config.py).
"""

from __future__ import annotations

from host.server.config import HostFacade, ServerConfig
from host.server.server import Server

__all__ = ["Server", "ServerConfig", "HostFacade"]
