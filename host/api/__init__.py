"""The WIT imports of world `pie:inferlet/inferlet@0.1.0`, one module per WIT interface.

Each module's `imports(...)` takes the services that interface needs (not the whole host) and
returns its functions by WIT name; `build_linker` registers them all. One linker serves every
instance: an import finds its caller with `host.wasm.instance.current()`.
"""

from __future__ import annotations

from dataclasses import dataclass

from wasmtime import Engine
from wasmtime.component import Linker

from gpu_backend.types import BackendInfo, Tokenizer
from host.api import forward, kv, messaging, model, runtime, store
from host.api.fastcall import add_func
from host.api.guest import Import
from host.batching.scheduler import Scheduler
from host.state.kvstore import KeyValueStore
from host.state.pages import PageManager
from host.state.topics import Topics

__all__ = ["ApiServices", "PACKAGE", "WIT_VERSION", "build_linker", "import_tables"]

PACKAGE = "pie:inferlet"
WIT_VERSION = "0.1.0"


@dataclass(frozen=True)
class ApiServices:
    """Everything the imports use: the model's facts, its tokenizer and the host's shared state."""

    info: BackendInfo
    tokenizer: Tokenizer
    pages: PageManager
    scheduler: Scheduler
    kvstore: KeyValueStore
    topics: Topics


def import_tables(s: ApiServices) -> dict[str, dict[str, Import]]:
    """Every import, by WIT interface and function name."""
    return {
        "runtime": runtime.imports(WIT_VERSION),
        "messaging": messaging.imports(s.topics),
        "store": store.imports(s.kvstore),
        "model": model.imports(s.info, s.tokenizer),
        "kv": kv.imports(s.pages, s.scheduler, s.info.page_size),
        "forward": forward.imports(s.pages, s.scheduler, s.info),
    }


def build_linker(engine: Engine, services: ApiServices) -> Linker:
    """A linker with WASI p2 and every import of our world."""
    linker = Linker(engine)
    linker.add_wasip2()
    with linker.root() as root:
        for iface, table in import_tables(services).items():
            with root.add_instance(f"{PACKAGE}/{iface}@{WIT_VERSION}") as li:
                for name, fn in table.items():
                    add_func(li, name, fn)
    return linker
