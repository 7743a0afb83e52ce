"""One wasmtime engine per host: epoch ticker and the compiled-component cache.

Compiling a componentize-py component takes seconds; a serialized one loads in ~3 ms.
Compiled components are cached on disk by sha256 of the .wasm bytes (plus the wasmtime
version, since serialized artifacts only load on the same version and config) and in memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path

import wasmtime
from wasmtime import Config, Engine, Store
from wasmtime.component import Component

from host.wasm.pooling import PoolingConfig
from host.wasm.reaper import StoreReaper

log = logging.getLogger(__name__)

WASMTIME_VERSION = version("wasmtime")


class CompileError(Exception):
    """wasmtime rejected a program; the message is the compiler's reason."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class WasmEngine:
    """The shared engine, its epoch ticker thread and compiled components by hash.

    `pooling`: use wasmtime's pooling instance allocator with these sizes (host/wasm/pooling.py);
    None keeps the on-demand allocator (no cap on instances, but slower instantiation).
    `busy`: whether the backend has work; with it, finished instances' stores are freed by a
    `StoreReaper` while it has none (up to `reap_pending` wait), else where they end; with
    `background`, by a reaper at the lowest CPU priority, at once unless `ramping()` (launched
    instances are starting, host/wasm/reaper.py), on `reapers` threads."""

    def __init__(self, cache_dir: Path, tick_ms: float = 10.0, pooling: PoolingConfig | None = None,
                 busy: Callable[[], bool] | None = None, reap_pending: int = 256, background: bool = False,
                 ramping: Callable[[], bool] | None = None, reapers: int = 1) -> None:
        cfg = Config()
        cfg.epoch_interruption = True
        cfg.wasm_component_model = True
        if pooling is not None:
            pooling.apply(cfg)
        self.pooling = pooling
        self.engine = Engine(cfg)
        self.tick_s = tick_ms / 1000
        self.cache_dir = cache_dir / "components" / f"wasmtime-{WASMTIME_VERSION}"
        self._components: dict[str, Component] = {}
        self._lock = threading.Lock()
        self._hash_locks: dict[str, threading.Lock] = {}
        self._stop = threading.Event()
        self.on_tick: list[Callable[[], None]] = []  # also called each tick (cheap checks only)
        self._ticker = threading.Thread(target=self._tick, name="pie-epoch", daemon=True)
        self._ticker.start()
        self.reaper = StoreReaper(busy, reap_pending, background=background, ramping=ramping, threads=reapers,
                                  on_free=self._freed) if busy is not None else None
        # Stores made and not freed yet, and the most there ever were at once (see `reusable_slots`).
        self._stores_lock = threading.Lock()
        self._stores_live = 0
        self._stores_peak = 0

    def new_store(self) -> Store:
        """A store for one instance (counted until `free_store` has freed it)."""
        store = Store(self.engine)
        with self._stores_lock:
            self._stores_live += 1
            self._stores_peak = max(self._stores_peak, self._stores_live)
        return store

    def free_store(self, store: Store) -> None:
        """Free a finished instance's store (through the reaper when there is one)."""
        if self.reaper is not None:
            self.reaper.put(store)
        else:
            store.close()
            self._freed()

    def _freed(self) -> None:
        with self._stores_lock:
            self._stores_live -= 1

    def reusable_slots(self) -> int:
        """Pool slots free now that an instance has used before, as far as the count tells: the next
        instantiations reuse them (the allocator gives a module the slots it last freed), their
        memory resident, instead of a slot never used, whose pages fault in and whose first reset
        costs ~25 ms (host/wasm/reaper.py). At most the pool's `warm_slots` (wasmtime keeps no more
        unused slots warm); 0 without the pooling allocator."""
        if self.pooling is None:
            return 0
        with self._stores_lock:
            return max(min(self._stores_peak - self._stores_live, self.pooling.warm_slots), 0)

    def reaping(self) -> bool:
        """Stores of finished instances wait to be freed and no slot used before is free: the warm
        pool waits for the frees. A store freed first gives its pool slot, memory already faulted
        in, to the next warm instance; warmed before, that instance takes a slot never used and
        faults its memory in while it serves (measured: ~250 page faults and ~3.5 ms of kernel time
        per `text_completion` instance, on the critical path of the next burst). While slots used
        before are free (`WasmEngine.reusable_slots`: a host's earlier bursts and `warm_start`'s
        priming left them), refills go on into those: bursts of 256 back to back otherwise found
        the pool short (bench/HISTORY.md, "Issue 40, fourth round")."""
        reaper = self.reaper
        return reaper is not None and reaper.pending() > 0 and self.reusable_slots() == 0

    def _tick(self) -> None:
        while not self._stop.wait(self.tick_s):
            self.engine.increment_epoch()
            for fn in self.on_tick:
                try:
                    fn()
                except Exception:  # the ticker must keep ticking: it is what stops runaway guests
                    log.exception("epoch tick callback failed")

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Stop the ticker and free the engine and its compiled components. A pooled engine holds
        its pool's address space (~1.3 TiB here) until it is freed, and Python's collector may
        never free it on its own (threads and callbacks keep the host in reference cycles):
        a process that makes many hosts would run out of address space, and wasmtime aborts then."""
        self.stop()
        if self._ticker is not threading.current_thread():
            self._ticker.join(5 * self.tick_s + 1)
        if self.reaper is not None:
            self.reaper.close()
        with self._lock:
            comps = list(self._components.values())
            self._components.clear()
        for comp in comps:
            comp.close()
        self.engine.close()

    def compile(self, wasm: bytes, program_hash: str | None = None) -> str:
        """Compile (or load from cache) a component; returns its sha256 hex.

        Raises CompileError with wasmtime's reason when the bytes are not a valid component.
        """
        h = program_hash or sha256_hex(wasm)
        with self._lock:
            if h in self._components:
                return h
            hlock = self._hash_locks.setdefault(h, threading.Lock())
        with hlock:  # two threads compiling the same program do the work once
            if h in self._components:
                return h
            comp = self._load_cached(h)
            if comp is None:
                try:
                    comp = Component(self.engine, wasm)
                except wasmtime.WasmtimeError as e:
                    raise CompileError(str(e).strip()) from None
                self._store_cached(h, comp)
            with self._lock:
                self._components[h] = comp
        return h

    def has(self, program_hash: str) -> bool:
        """Whether the program is compiled (in memory or in the disk cache, which is then loaded)."""
        with self._lock:
            if program_hash in self._components:
                return True
        comp = self._load_cached(program_hash)
        if comp is None:
            return False
        with self._lock:
            self._components[program_hash] = comp
        return True

    def get(self, program_hash: str) -> Component:
        if not self.has(program_hash):
            raise KeyError(f"unknown program {program_hash!r}: upload or compile it first")
        with self._lock:
            return self._components[program_hash]

    def _path(self, h: str) -> Path:
        return self.cache_dir / f"{h}.cwasm"

    def _load_cached(self, h: str) -> Component | None:
        if len(h) != 64 or any(c not in "0123456789abcdef" for c in h):
            return None
        path = self._path(h)
        if not path.exists():
            return None
        try:
            return Component.deserialize_file(self.engine, str(path))
        except wasmtime.WasmtimeError as e:  # stale or corrupt artifact: recompile from source
            log.warning("ignoring unusable cached component %s: %s", path, e)
            return None

    def _store_cached(self, h: str, comp: Component) -> None:
        path = self._path(h)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(bytes(comp.serialize()))
            tmp.replace(path)
        except OSError as e:  # a read-only cache only costs the next start a recompile
            log.warning("could not cache compiled component at %s: %s", path, e)
