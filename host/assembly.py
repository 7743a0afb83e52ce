"""What a `Host` is built from, besides its own bookkeeping: the backend (loaded in-process or
started as engine processes), one replica per engine (page manager, scheduler, suspender), and
the worker processes its instances' guests run in.
"""

from __future__ import annotations

import inspect
import logging
import pickle
from collections.abc import Callable
from typing import Any

from gpu_backend.types import Backend
from host.api import PACKAGE, WIT_VERSION, ApiServices, version_tables
from host.api import grammar as grammar_api
from host.batching.policy import make_policy
from host.batching.scheduler import Scheduler
from host.config import HostConfig
from host.net.client import HttpService
from host.replicas import Replica
from host.state.pages import PageManager
from host.state.prefix_cache import PrefixCache
from host.suspend import Suspender
from host.wasm.limits import InstanceLimits
from host.wasm.pooling import PoolingConfig
from host.workers.pool import WorkerPool
from host.workers.worker import WorkerSpec

__all__ = ["http_service", "instance_limits", "instance_pool", "load_backend", "make_replicas", "start_engines",
           "start_workers"]

log = logging.getLogger(__name__)


def load_backend(config: HostConfig, progress: bool) -> Backend:
    """`config.model` loaded in this process (gpu_backend.load_backend)."""
    import torch

    from gpu_backend import load_backend as load

    dtype = None if config.dtype is None else getattr(torch, config.dtype)
    return load(config.model, device=config.device, dtype=dtype, page_size=config.page_size,
                num_pages=config.num_pages, kv_memory_bytes=config.kv_memory_bytes, progress=progress,
                gpu_memory_utilization=config.gpu_memory_utilization)


def start_engines(config: HostConfig) -> list[Any]:
    """`config.replicas` engine processes of `config.tp` ranks each (gpu_backend/engine/client.py)."""
    from gpu_backend.engine.client import EngineSpec
    from gpu_backend.engine.client import start_engines as start

    spec = EngineSpec(model=config.model, device=config.device, dtype=config.dtype, page_size=config.page_size,
                      num_pages=config.num_pages, kv_memory_bytes=config.kv_memory_bytes, tp=config.tp,
                      gpu_memory_utilization=config.gpu_memory_utilization)
    return start(spec, config.replicas, restart=config.engine_restart)


def start_workers(config: HostConfig, services: ApiServices, limits: InstanceLimits,
                   pool_slots: int | None) -> WorkerPool:
    """The instance workers: every import of every WIT version, stubbed in each worker, runs here."""
    tables = version_tables(services)
    names = {v: {iface: sorted(t) for iface, t in ifaces.items()} for v, ifaces in tables.items()}
    imports: dict[str, Callable[..., Any]] = {f"{iface}.{n}": fn for ifaces in tables.values()
                                              for iface, t in ifaces.items() for n, fn in t.items()}
    resources: dict[str, list[tuple[str, int]]] = {}
    for res, (_ty, dtor) in grammar_api.resources(services.grammars).items():
        resources.setdefault("grammar", []).append((res, {"grammar": grammar_api.GRAMMAR_TYPE,
                                                          "matcher": grammar_api.MATCHER_TYPE}[res]))
        imports[f"$drop.grammar.{res}"] = dtor
    # the model's constants (imports declared `before_launch` that take no argument): the same
    # answer for every instance, so a worker gives it without a round trip
    constants = {name: fn.__wrapped__(None) for name, fn in imports.items()  # type: ignore[attr-defined]
                 if getattr(fn, "before_launch", False)
                 and len(inspect.signature(fn.__wrapped__).parameters) == 1}  # type: ignore[attr-defined]
    try:  # the tokenizer's imports are answered in the workers, if it pickles (host/workers/worker.py)
        tokenizer: bytes | None = pickle.dumps(services.tokenizer)
    except Exception as e:
        log.info("the tokenizer does not pickle (%s: %s): its imports run in the host", type(e).__name__, e)
        tokenizer = None
    spec = WorkerSpec(index=0, cache_dir=config.cache_dir, epoch_tick_ms=config.epoch_tick_ms, limits=limits,
                      pool_slots=pool_slots, imports=names, resources=resources, package=PACKAGE,
                      constants=constants, wit_version=WIT_VERSION, info=services.info, tokenizer=tokenizer,
                      warm_in_background=config.warm_yield)
    return WorkerPool(config.worker_count, spec, imports)


def make_replicas(config: HostConfig, backend: Backend | None, engines: list[Any],
                  progress: bool) -> tuple[Backend, list[Replica]]:
    """The backend (the first engine's; `backend`; or `config.model` loaded on the first scheduler's
    thread, where its forwards will run) and one replica per engine process, one for an in-process
    backend: its page manager (with the prefix cache), its scheduler bound to that engine, its
    suspender."""
    policy = lambda: make_policy(config.policy, config.batch_k, config.batch_t_ms, config.launch_grace_ms)  # noqa: E731
    if engines:
        backend = engines[0]
    schedulers = [Scheduler(policy(), max_batch_tokens=config.max_batch_tokens, prefill_chunk=config.prefill_chunk,
                            aging_s=config.priority_aging_s, prefill_ratio=config.prefill_ratio)
                  for _ in range(max(1, len(engines)))]
    if backend is None:
        try:
            backend = schedulers[0].call(lambda: load_backend(config, progress))
        except BaseException:
            schedulers[0].stop()
            raise
    assert backend is not None
    backends: list[Backend] = engines or [backend]
    info = backend.info
    log.info("KV cache: %d pages of %d tokens (%d tokens)%s; swap space for suspended instances: %d MiB",
             info.num_pages, info.page_size, info.num_pages * info.page_size,
             f" on each of {len(backends)} replicas" if len(backends) > 1 else "", config.swap_memory_bytes // 2**20)
    managers = [PageManager(info.num_pages, config.max_pages_per_instance,
                            PrefixCache(info.page_size, config.prefix_cache) if config.prefix_cache != "off"
                            else None, max_pages_per_tenant=config.max_pages_per_tenant) for _ in backends]
    for sched, b, pm in zip(schedulers, backends, managers, strict=True):
        start = getattr(b, "start_forward", None) if config.run_ahead else None
        sched.bind(b.forward, b.copy_tokens, info.page_size, pins=pm, start=start,
                   feeds=bool(getattr(b, "feeds", False)))
        sched.backend = b  # (its `call` work reaches the backend itself: embeddings)
    replicas = [Replica(r, pm, sched, Suspender(pm, sched, b, config.swap_memory_bytes))
                for r, (pm, sched, b) in enumerate(zip(managers, schedulers, backends, strict=True))]
    return backend, replicas


def instance_limits(config: HostConfig) -> InstanceLimits:
    """What each instance may use (memory, wall clock, published messages, inbox)."""
    return InstanceLimits(config.memory_limit_bytes, config.wall_budget_s,
                          max_published_messages=config.max_published_messages,
                          max_published_bytes=config.max_published_bytes,
                          max_inbox_bytes=config.max_inbox_bytes)


def instance_pool(config: HostConfig, slots: int, limits: InstanceLimits) -> PoolingConfig | None:
    """wasmtime's pooling allocator with `slots` instance slots (`config.instance_pool`); None: the
    on-demand allocator (also where the address space is limited)."""
    if not config.instance_pool:
        return None
    if not PoolingConfig.address_space_ok():
        log.warning("address space is limited (ulimit -v): instances use the on-demand allocator")
        return None
    return PoolingConfig(slots, limits)


def http_service(config: HostConfig) -> HttpService:
    """The guests' outbound HTTP (host/net/), with the allow-lists of `config`."""
    tenant_allow: dict[str, list[str]] = {}
    for tenant, pattern in config.http_tenant_allow:
        tenant_allow.setdefault(tenant, []).append(pattern)
    return HttpService(config.http_allow, tenant_allow, config.http_limits)
