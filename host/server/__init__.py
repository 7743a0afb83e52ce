"""The server layer (`pie-serve`): one port, one Starlette app on uvicorn, in front of one host:
protocol v1 over WebSocket, the OpenAI-compatible routes, /health and /metrics.

`Server` (server.py) serves the app and routes WebSocket frames; `openai_api.py` the HTTP routes
(docs/openai.md); `RequestHandlers` (handlers.py)
answers each request; `InstanceTable` (instances.py) tracks which connection owns which
instance and buffers detached ones' events; `ProgramStore` (programs.py) keeps uploaded
components on disk, per tenant; `TenantLimits` (tenants.py) counts each tenant's instances and
connections; http.py bounds HTTP itself (header and body deadlines, body size, SSE write
timeout). The server reaches the host only through `HostFacade` (config.py).
"""

from __future__ import annotations

from host.server.config import HostFacade, ServerConfig
from host.server.server import Server

__all__ = ["Server", "ServerConfig", "HostFacade"]
