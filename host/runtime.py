"""The host: loads the backend, runs inferlet instances, routes their forwards and messages.

    host = Host(HostConfig())
    h = host.compile(open("app.wasm", "rb").read())
    iid = host.launch(h, ["--prompt", "hi"], on_event=print)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from host.config import HostConfig
from host.engine import CompileError, WasmEngine, sha256_hex
from host.gate import RunGate
from host.imports import bind, build_linker
from host.instance import TERMINAL_EVENTS, Instance, InstanceEvent
from host.kv import PageManager
from host.kvstore import KeyValueStore
from host.scheduler import Scheduler

__all__ = ["Host", "HostConfig", "InstanceEvent", "CompileError", "TERMINAL_EVENTS", "sha256_hex"]

log = logging.getLogger(__name__)


def _load_backend(config: HostConfig, progress: bool) -> Any:
    import torch

    from gpu_backend import load_backend

    dtype = None if config.dtype is None else getattr(torch, config.dtype)
    return load_backend(config.model, device=config.device, dtype=dtype, page_size=config.page_size,
                        num_pages=config.num_pages, kv_memory_bytes=config.kv_memory_bytes, progress=progress)


class Host:
    """One backend, one wasm engine, many sandboxed instances."""

    def __init__(self, config: HostConfig | None = None, backend: Any = None, progress: bool = True) -> None:
        self.config = config = config or HostConfig()
        self.scheduler = Scheduler(None if backend is None else backend.forward, config.page_size,
                                   policy=config.policy, max_batch_tokens=config.max_batch_tokens,
                                   k=config.batch_k, t_ms=config.batch_t_ms)
        if backend is None:  # loaded on the scheduler thread, where its forwards will run
            try:
                backend = self.scheduler.call(lambda: _load_backend(config, progress))
            except BaseException:
                self.scheduler.stop()
                raise
        self.backend = backend
        info = backend.info
        self.scheduler.bind(backend.forward, info.page_size)
        self.model_name: str = info.name
        self.pages = PageManager(info.num_pages, config.max_pages_per_instance)
        self.total_pages: int = info.num_pages
        self.wasm = WasmEngine(config.cache_dir, config.epoch_tick_ms)
        data_dir = config.data_dir or config.cache_dir
        self.kvstore = KeyValueStore(data_dir / "kvstore.sqlite3")
        self._instances: dict[str, Instance] = {}
        self._ended: dict[str, Instance] = {}  # recently ended, for wait()
        self._topics: dict[str, set[Instance]] = {}
        self._lock = threading.Lock()
        self.gate = RunGate(config.run_gate, slots=config.run_slots)
        self.wasm.on_tick.append(self.gate.poll)  # queued wake-ups go out even if holders stall
        self.linker = build_linker(self)
        self._closed = False

    # ---- programs ----
    def compile(self, wasm: bytes) -> str:
        """Compile (cached on disk) a component; returns its sha256. Raises CompileError."""
        return self.wasm.compile(wasm)

    def has_program(self, program_hash: str) -> bool:
        return self.wasm.has(program_hash)

    # ---- instances ----
    def launch(self, program_hash: str, args: list[str],
               on_event: Callable[[InstanceEvent], None] | None = None) -> str:
        """Start an instance of a compiled program; returns its id. KeyError for an unknown program."""
        if self._closed:
            raise RuntimeError("host is shut down")
        self.wasm.get(program_hash)  # KeyError with a clear message if unknown
        inst = Instance(self, program_hash, args, on_event or (lambda ev: None))
        with self._lock:
            self._instances[inst.id] = inst
        self.scheduler.expect(inst.id)
        inst.start()
        return inst.id

    def _get(self, instance_id: str) -> Instance:
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return inst

    def signal(self, instance_id: str, message: str) -> None:
        """Deliver a client message to the instance's receive()."""
        inst = self._get(instance_id)
        with inst.cond:
            inst.inbox.append(message)
            inst.cond.notify_all()

    def close_input(self, instance_id: str) -> None:
        """From now on the instance's receive() returns none once its inbox is empty."""
        inst = self._get(instance_id)
        with inst.cond:
            inst.input_closed = True
            inst.cond.notify_all()

    def terminate(self, instance_id: str, reason: str = "terminated by request") -> None:
        """Stop an instance; it ends with an `aborted` event carrying `reason`."""
        self._get(instance_id).terminate(reason)

    def wait(self, instance_id: str, timeout: float | None = None) -> bool:
        """Block until the instance has ended (its terminal event was emitted)."""
        with self._lock:
            inst = self._instances.get(instance_id) or self._ended.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return inst.join(timeout)

    def instance_ended(self, inst: Instance) -> None:
        """Called by the instance thread as it ends: release everything it held."""
        with self._lock:
            self._instances.pop(inst.id, None)
            self._ended[inst.id] = inst
            if len(self._ended) > 1024:
                self._ended.pop(next(iter(self._ended)))
            for subs in self._topics.values():
                subs.discard(inst)
        for h, fut in list(inst.forwards.items()):
            # A forward still queued or running finishes on its own; the pages go back only
            # after it completes, so the backend never writes into a page someone else owns.
            if not fut.done():
                fut.wait()
            del inst.forwards[h]
        self.pages.release_all(inst.pages)
        self.scheduler.forget(inst.id)

    def instances(self) -> list[dict[str, Any]]:
        with self._lock:
            insts = list(self._instances.values())
        return [{"id": i.id, "program": i.program, "arguments": i.args, "state": i.state,
                 "started_at": i.started_at} for i in insts]

    # ---- pub/sub ----
    def subscribe(self, inst: Instance, topic: str) -> None:
        with self._lock:
            self._topics.setdefault(topic, set()).add(inst)

    def unsubscribe(self, inst: Instance, topic: str) -> None:
        with self._lock:
            self._topics.get(topic, set()).discard(inst)

    def publish(self, topic: str, message: str) -> None:
        with self._lock:
            subs = list(self._topics.get(topic, ()))
        for inst in subs:
            with inst.cond:
                inst.published.append((topic, message))
                inst.cond.notify_all()

    # ---- threads and backend ----
    def bind_thread(self, inst: Instance) -> None:
        bind(inst)

    def unbind_thread(self) -> None:
        bind(None)

    # ---- introspection ----
    def model_names(self) -> list[str]:
        return [self.model_name]

    def free_pages(self) -> int:
        return self.pages.free_count

    def stats(self) -> dict[str, Any]:
        with self._lock:
            running = len(self._instances)
        return {"scheduler": self.scheduler.stats.as_dict(), "policy": self.config.policy,
                "instances": running, "free_pages": self.pages.free_count, "total_pages": self.total_pages,
                "model": self.model_name}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Terminate every instance, then stop the scheduler and the epoch ticker."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            insts = list(self._instances.values())
        for inst in insts:
            inst.terminate("host shutting down")
        for inst in insts:
            inst.join(timeout)
        self.scheduler.stop()
        self.wasm.stop()
        self.kvstore.close()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
