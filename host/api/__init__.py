"""The WIT imports of world `pie:inferlet/inferlet`, one module per WIT interface.

Each module's `imports(...)` takes the services that interface needs (not the whole host) and
returns its functions by WIT name; `build_linker` registers them all, for every WIT version
shipped (`WIT_VERSIONS`): a component built against 0.1.0 keeps running on this host, its calls
served by the same functions (0.2.0 adds `forward.generate` / `generate-fresh`, `kv.attach-prefix` and structured generation:
interface `grammar` with its resources, and `forward.*-constrained`; 0.3.0 adds
`model.apply-chat-template-json`, `model.encode-prompt` and `forward.run-scored`; 0.4.0 adds
`runtime.set-priority` and `runtime.priority`; 0.5.0 adds interface `http` and child inferlets,
`runtime.launch` and the `runtime.child-*` calls, and interface `embed`). One linker serves every
instance: an import finds its caller with `host.wasm.instance.current()`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from wasmtime import Engine
from wasmtime.component import Linker

from gpu_backend.types import BackendInfo, Tokenizer
from host.api import constrained, embed, forward, grammar, http, kv, messaging, model, runtime, store, wasi
from host.api.fastcall import add_func
from host.api.guest import Import
from host.children import Children
from host.net.client import HttpService
from host.replicas import ExportNames, Replica
from host.state.kvstore import KeyValueStore
from host.state.topics import Topics
from host.wasm.instance import Instance

__all__ = ["ApiServices", "PACKAGE", "WIT_VERSION", "WIT_VERSIONS", "build_linker", "import_tables", "version_tables"]

PACKAGE = "pie:inferlet"
WIT_VERSION = "0.5.0"  # the newest: what runtime.version reports and pie-build targets
# Every version served, with the functions each added (the rest exist in all versions).
_GRAMMAR_0_2 = {f"grammar.[static]grammar.{n}" for n in ("from-json-schema", "from-regex", "from-ebnf", "from-lark",
                                                            "any-json")} | {"grammar.[method]grammar.matcher"} | {
    f"grammar.[method]matcher.{n}" for n in ("accept", "rollback", "accepted", "is-terminated", "reset", "fork")}
WIT_VERSIONS: dict[str, set[str]] = {"0.1.0": set(), "0.2.0": {
    "forward.generate", "forward.generate-fresh", "kv.attach-prefix", "forward.run-constrained", "forward.submit-constrained",
    "forward.decode-step-constrained", "forward.generate-constrained"} | _GRAMMAR_0_2,
    "0.3.0": {"model.apply-chat-template-json", "model.encode-prompt", "forward.run-scored"},
    "0.4.0": {"runtime.set-priority", "runtime.priority"},
    "0.5.0": {"http.fetch"} | {f"runtime.{n}" for n in ("launch", "child-id", "child-send", "child-receive",
                                                         "child-wait", "child-terminate", "child-release", "parent")}
    | {f"embed.{n}" for n in ("hidden-size", "image-tokens", "image-token-id", "embed-image", "embed-text", "slot-len",
                              "release", "run", "hidden")}}


@dataclass(frozen=True)
class ApiServices:
    """Everything the imports use: the model's facts, its tokenizer and the host's shared state."""

    info: BackendInfo
    tokenizer: Tokenizer
    replicas: list[Replica]  # the engines' pages and schedulers; an instance uses `replicas[inst.pages.replica]`
    kvstore: KeyValueStore
    topics: Topics
    step_lookahead: bool = True  # HostConfig.step_lookahead
    http: HttpService = field(default_factory=HttpService)  # outbound HTTP (off without an allowlist)
    children: Children | None = None  # child inferlets (the host's; None: runtime.launch traps)
    slot_limits: embed.SlotLimits = field(default_factory=embed.SlotLimits)  # per instance (HostConfig.max_embedding_*)

    @cached_property
    def export_names(self) -> ExportNames:
        """Export names, unique per tenant across the replicas."""
        return ExportNames(self.replicas)

    @cached_property
    def slots(self) -> embed.Slots:
        """Per-instance embedding slots (release them as instances end)."""
        return embed.Slots(int(getattr(self.info, "hidden_size", 0) or 0), self.slot_limits)

    @cached_property
    def grammars(self) -> grammar.Grammars:
        """Grammar compiler and per-instance grammar / matcher tables (release them as instances end)."""
        return grammar.Grammars(self.tokenizer, self.info)

    def release(self, inst: Instance) -> None:
        """An ended instance gives back what the imports' services hold for it: its children end
        with it (unless detached), its subscriptions, grammars and matchers, embedding slots go."""
        if self.children is not None:
            self.children.ended(inst)
        self.topics.drop(inst)
        self.grammars.release(inst)
        self.slots.drop(inst)


def import_tables(s: ApiServices) -> dict[str, dict[str, Import]]:
    """Every import, by WIT interface and function name."""
    return {
        "runtime": runtime.imports(WIT_VERSION, s.replicas, s.children),
        "http": http.imports(s.http),
        "embed": embed.imports(s.replicas, s.info, s.slots),
        "messaging": messaging.imports(s.topics),
        "store": store.imports(s.kvstore),
        "model": model.imports(s.info, s.tokenizer),
        "kv": kv.imports(s.replicas, s.export_names, s.info.page_size),
        "grammar": grammar.imports(s.grammars),
        "forward": {**forward.imports(s.replicas, s.info, s.tokenizer, s.step_lookahead),
                    **constrained.imports(s.replicas, s.info, s.tokenizer, s.grammars)},
    }


def version_tables(s: ApiServices) -> dict[str, dict[str, dict[str, Import]]]:
    """Every import of every WIT version served: version -> interface -> name -> function."""
    tables = import_tables(s)
    out: dict[str, dict[str, dict[str, Import]]] = {}
    newer: set[str] = set()
    for version in sorted(WIT_VERSIONS, key=lambda v: tuple(map(int, v.split("."))), reverse=True):
        served = {iface: {n: fn for n, fn in table.items() if f"{iface}.{n}" not in newer}
                  for iface, table in tables.items()}
        out[version] = {iface: table for iface, table in served.items() if table}
        newer |= WIT_VERSIONS[version]
    return out


def build_linker(engine: Engine, services: ApiServices) -> Linker:
    """A linker with WASI p2 and every import of our world, in every version shipped."""
    linker = Linker(engine)
    linker.add_wasip2()
    wasi.add_clock_waits(linker, engine)  # clock waits that terminate and the budget can end
    resources = grammar.resources(services.grammars)
    with linker.root() as root:
        for version, tables in version_tables(services).items():
            for iface, table in tables.items():
                with root.add_instance(f"{PACKAGE}/{iface}@{version}") as li:
                    for res, (ty, dtor) in (resources if iface == "grammar" else {}).items():
                        li.add_resource(res, ty, dtor)
                    for name, fn in table.items():
                        add_func(li, name, fn, label=f"{iface}.{name}")
    return linker
