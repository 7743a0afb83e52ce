"""The client layer: protocol v1 types and the Python client library.

Imports neither torch nor wasmtime (nor tiktoken, jinja2): a process that only talks to a
server, such as `pie-run --server`, stays light. tests/test_client_imports.py checks it.
"""

from __future__ import annotations

from host.client.client import ConnectionLost, Event, PieClient, PieError
from host.client.remote import EXIT_CODES, run_remote
from host.client.sync import SyncPieClient

__all__ = ["PieClient", "SyncPieClient", "Event", "PieError", "ConnectionLost", "run_remote", "EXIT_CODES"]
