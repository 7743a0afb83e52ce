"""The `Host` facade: one backend, one wasm engine, many sandboxed instances.

    with Host(HostConfig()) as host:
        program = host.compile(open("app.wasm", "rb").read())
        iid = host.launch(program, ["--prompt", "hi"], on_event=print)
        host.wait(iid)

It composes the layers (see docs/architecture.md) and hands each part only what it needs:
instances get an `InstanceEnv`, the WIT imports get `ApiServices`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gpu_backend.types import Backend
from host.api import ApiServices, build_linker
from host.batching.gate import RunGate
from host.batching.policy import make_policy
from host.batching.scheduler import Scheduler
from host.config import HostConfig
from host.events import InstanceEvent
from host.state.kvstore import KeyValueStore
from host.state.pages import PageManager
from host.state.prefix_cache import PrefixCache
from host.state.topics import Topics
from host.wasm.engine import WasmEngine
from host.wasm.instance import Instance, InstanceEnv
from host.wasm.limits import InstanceLimits
from host.wasm.pooling import PoolingConfig
from host.wasm.warm import WarmPool

__all__ = ["Host", "HostBusy"]

log = logging.getLogger(__name__)

_ENDED_KEPT = 1024  # ended instances remembered for wait()
_WARM_PROGRAMS = 4  # programs kept warm at once (the most recently launched)


class HostBusy(RuntimeError):
    """A launch refused because `HostConfig.max_instances` instances are running."""


def _load_backend(config: HostConfig, progress: bool) -> Backend:
    import torch

    from gpu_backend import load_backend

    dtype = None if config.dtype is None else getattr(torch, config.dtype)
    return load_backend(config.model, device=config.device, dtype=dtype, page_size=config.page_size,
                        num_pages=config.num_pages, kv_memory_bytes=config.kv_memory_bytes, progress=progress)


class Host:
    """Runs inferlet instances against one backend (any object implementing `gpu_backend.types.Backend`;
    None loads `config.model`)."""

    def __init__(self, config: HostConfig | None = None, backend: Backend | None = None,
                 progress: bool = True) -> None:
        self.config = config = config or HostConfig()
        self.scheduler = Scheduler(make_policy(config.policy, config.batch_k, config.batch_t_ms),
                                   max_batch_tokens=config.max_batch_tokens)
        if backend is None:  # loaded on the scheduler thread, where its forwards will run
            try:
                backend = self.scheduler.call(lambda: _load_backend(config, progress))
            except BaseException:
                self.scheduler.stop()
                raise
        assert backend is not None
        self.backend = backend
        info = backend.info
        self.model_name: str = info.name
        self.total_pages: int = info.num_pages
        cache = PrefixCache(info.page_size, config.prefix_cache) if config.prefix_cache != "off" else None
        self.pages = PageManager(info.num_pages, config.max_pages_per_instance, cache)
        self.scheduler.bind(backend.forward, backend.copy_tokens, info.page_size, pins=self.pages)
        limits = InstanceLimits(config.memory_limit_bytes, config.wall_budget_s,
                                max_published_messages=config.max_published_messages,
                                max_published_bytes=config.max_published_bytes)
        slots = config.max_instances + config.warm_instances * _WARM_PROGRAMS + 8
        pooling = None
        if config.instance_pool:
            if PoolingConfig.address_space_ok():
                pooling = PoolingConfig(slots, limits)
            else:
                log.warning("address space is limited (ulimit -v): instances use the on-demand allocator")
        self.wasm = WasmEngine(config.cache_dir, config.epoch_tick_ms, pooling)
        self.kvstore = KeyValueStore((config.data_dir or config.cache_dir) / "kvstore.sqlite3")
        self.topics = Topics()
        self.gate = RunGate(config.run_gate, slots=config.run_slots)
        self.wasm.on_tick.append(self.gate.poll)  # queued wake-ups go out even if holders stall
        self.services = ApiServices(
            info=info, tokenizer=backend.tokenizer, pages=self.pages, scheduler=self.scheduler,
            kvstore=self.kvstore, topics=self.topics)
        self.linker = build_linker(self.wasm.engine, self.services)
        self._env = InstanceEnv(
            engine=self.wasm, linker=self.linker, gate=self.gate,
            limits=limits, on_block=self.scheduler.forget, on_end=self._instance_ended)
        self._instances: dict[str, Instance] = {}
        self._ended: OrderedDict[str, Instance] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self.warm = WarmPool(lambda program: Instance(self._env, program, [], _ignore, warm=True),
                             config.warm_instances, _WARM_PROGRAMS)

    # ---- programs ----
    def compile(self, wasm: bytes) -> str:
        """Compile (cached on disk) a component; returns its sha256. Raises CompileError."""
        return self.wasm.compile(wasm)

    def has_program(self, program_hash: str) -> bool:
        return self.wasm.has(program_hash)

    # ---- instances ----
    def launch(self, program_hash: str, args: list[str],
               on_event: Callable[[InstanceEvent], None] | None = None, tenant: str = "local") -> str:
        """Start an instance of a compiled program; returns its id. KeyError for an unknown program.

        `tenant` is the client identity the instance acts for: it sees only that tenant's KV exports.
        Raises HostBusy when `max_instances` are running. A warm instance is used when one is ready."""
        if self._closed:
            raise RuntimeError("host is shut down")
        self.wasm.get(program_hash)  # KeyError with a clear message if unknown
        listener = on_event or _ignore
        with self._lock:
            if len(self._instances) >= self.config.max_instances:
                raise HostBusy(f"the host is running its maximum of {self.config.max_instances} instances; "
                               "try again when some have ended (or raise --max-instances)")
            inst = self.warm.take(program_hash)
            if inst is not None and not inst.launch(args, listener, tenant):
                inst = None
            cold = inst is None
            if inst is None:
                inst = Instance(self._env, program_hash, args, listener)
                inst.pages.tenant = tenant
            self._instances[inst.id] = inst
        self.scheduler.expect(inst.id)
        if cold:
            inst.start()
        return inst.id

    def prewarm(self, program_hash: str, n: int, timeout_s: float = 60.0) -> int:
        """Keep `n` instances of a program started ahead of demand from now on, and wait until
        they are ready (or `timeout_s`); returns how many are. n = 0 stops keeping it warm.
        See host/wasm/warm.py."""
        self.wasm.get(program_hash)
        return self.warm.prewarm(program_hash, n, timeout_s)

    def _get(self, instance_id: str) -> Instance:
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return inst

    def signal(self, instance_id: str, message: str) -> None:
        """Deliver a client message to the instance's receive()."""
        self._get(instance_id).signal(message)

    def close_input(self, instance_id: str) -> None:
        """From now on the instance's receive() returns none once its inbox is empty."""
        self._get(instance_id).close_input()

    def terminate(self, instance_id: str, reason: str = "terminated by request") -> None:
        """Stop an instance; it ends with an `aborted` event carrying `reason`."""
        self._get(instance_id).terminate(reason)

    def wait(self, instance_id: str, timeout: float | None = None) -> bool:
        """Block until the instance has ended (its terminal event was emitted); False on timeout."""
        with self._lock:
            inst = self._instances.get(instance_id) or self._ended.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return inst.join(timeout)

    def _instance_ended(self, inst: Instance) -> None:
        """On the instance's thread as it ends: release everything it held."""
        with self._lock:
            self._instances.pop(inst.id, None)
            if not inst.parked:  # a warm instance never launched is known to no one
                self._ended[inst.id] = inst
            if len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)
        self.topics.drop(inst)
        self.services.grammars.release(inst)  # its grammars and matchers
        with inst.cond:
            inst.published.clear()  # unread messages go with their subscriber
        # A forward still queued or running finishes on its own (its pages stay pinned until it
        # has, so the backend never writes into a page someone else owns); waiting for it here
        # means the instance's pages are all free by the time its end is reported.
        for fut in inst.forwards.values():
            if not fut.done():
                fut.wait()
        inst.forwards.clear()
        self.pages.release_all(inst.pages)
        self.scheduler.forget(inst.id)

    def instances(self) -> list[dict[str, Any]]:
        """The running instances: id, program, arguments, state, started_at."""
        with self._lock:
            insts = list(self._instances.values())
        return [{"id": i.id, "program": i.program, "arguments": i.args, "state": i.state,
                 "started_at": i.started_at} for i in insts]

    # ---- introspection ----
    def model_names(self) -> list[str]:
        return [self.model_name]

    def free_pages(self) -> int:
        """KV pages on the free list now."""
        return self.pages.free_count

    def stats(self) -> dict[str, Any]:
        with self._lock:
            running = len(self._instances)
        cache = self.pages.cache
        return {"scheduler": self.scheduler.stats.as_dict(), "policy": self.config.policy,
                "instances": running, "free_pages": self.pages.free_count, "total_pages": self.total_pages,
                "model": self.model_name,
                "prefix_cache": cache.as_dict() if cache is not None else {"mode": "off"}}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Terminate every instance, then stop the scheduler and the epoch ticker."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            insts = list(self._instances.values()) + self.warm.close()
        for inst in insts:
            inst.terminate("host shutting down")
        for inst in insts:
            inst.join(timeout)
        self.scheduler.stop()
        self.linker.close()
        self.wasm.close()  # instances not joined above keep what they use alive (wasmtime refcounts)
        self.kvstore.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _ignore(_event: InstanceEvent) -> None:
    """The event listener of an instance launched without one (and of a warm one not launched yet)."""
