"""Per-instance limits, how a store enforces them, and the epoch callback for running guest code.

Memory. `InstanceLimits.memory_bytes` caps everything an instance's component can allocate in
linear memories and tables together, however many core instances it is made of. wasmtime's
store limits count per store (one store per instance) but cap each memory and each table on its
own, so the cap is split by a fixed rule (`InstanceLimits.store_limits`):

    max_tables * table_elements * 8 B  +  max_memories * memory_size  <=  memory_bytes

Tables get at most an eighth of the cap (`max_table_elements` each, fewer for small caps) and the
memories share the rest equally. A componentize-py inferlet needs 1 memory (13.3 MiB at start),
2 tables (the larger 5,710 elements) and 14 core instances; the defaults leave it the whole cap
minus 2 MiB for tables (caps of 16 MiB and more); host/api/wasi.py adds one core instance on
its first clock wait. A component that defines more memories, tables or instances than allowed
is refused at instantiation with a message naming the limit; a `memory.grow` / `table.grow` past
a limit returns -1 to the guest (a Python guest raises MemoryError).

Time. wasmtime calls the epoch deadline callback on the instance's own thread each time the
guest's deadline passes, i.e. once per epoch tick while wasm code runs. It traps the guest when
the owner says so (terminated, over its wall-clock budget) and otherwise extends the deadline by
one tick. Lowering a deadline from another thread does not work: compiled code caches the
deadline, so the callback is the only prompt way to stop a spinning guest.
"""

from __future__ import annotations

import ctypes
import itertools
import re
from dataclasses import dataclass
from typing import Protocol

from wasmtime import Store
from wasmtime import _ffi as ffi

__all__ = ["EpochOwner", "InstanceLimits", "StoreLimits", "watch_epochs", "unwatch_epochs"]

MIB = 2**20
WASM_PAGE = 65536
TABLE_ELEMENT_BYTES = 8  # wasmtime: "currently each table element takes 8 bytes"


@dataclass(frozen=True)
class StoreLimits:
    """The values handed to wasmtime's `Store.set_limits`, derived from `InstanceLimits`."""

    memory_size: int  # bytes, per linear memory
    table_elements: int  # per table
    instances: int
    tables: int
    memories: int

    @property
    def total_bytes(self) -> int:
        """The most the memories and tables can hold together."""
        return self.memories * self.memory_size + self.tables * self.table_elements * TABLE_ELEMENT_BYTES


@dataclass(frozen=True)
class InstanceLimits:
    """What one instance may use (see the module docstring for how the memory cap is split).

    memory_bytes: cap on all linear memories and tables of the component together.
    wall_budget_s: wall-clock budget from launch, also while blocked in an import (None = unlimited).
    max_memories / max_tables / max_instances: how many linear memories, tables and core wasm
    instances the component may create. max_table_elements: elements per table, at most.
    max_published_messages / max_published_bytes: the instance's unread pub/sub messages
    (host/state/topics.py `Mailbox`: when full, the oldest are dropped).
    """

    memory_bytes: int = 512 * MIB
    wall_budget_s: float | None = None
    max_memories: int = 1
    max_tables: int = 4
    max_instances: int = 32
    max_table_elements: int = 65536
    # unread pub/sub messages kept per instance (count, bytes); when full the oldest are dropped
    max_published_messages: int = 1024
    max_published_bytes: int = 1 * MIB
    # bytes of client messages (signals) waiting for the guest's receive(); one past it is refused
    max_inbox_bytes: int = 4 * MIB

    def __post_init__(self) -> None:
        for name in ("max_memories", "max_tables", "max_instances", "max_table_elements"):
            if getattr(self, name) < 1:
                raise ValueError(f"InstanceLimits.{name} must be at least 1, got {getattr(self, name)}")
        if self.store_limits.memory_size < WASM_PAGE:
            raise ValueError(f"memory_bytes {self.memory_bytes} leaves less than one 64 KiB page per "
                             f"linear memory for {self.max_memories} memories")

    @property
    def store_limits(self) -> StoreLimits:
        table_elements = min(self.max_table_elements,
                             self.memory_bytes // 8 // (self.max_tables * TABLE_ELEMENT_BYTES))
        table_bytes = self.max_tables * max(table_elements, 1) * TABLE_ELEMENT_BYTES
        return StoreLimits(memory_size=(self.memory_bytes - table_bytes) // self.max_memories,
                           table_elements=max(table_elements, 1), instances=self.max_instances,
                           tables=self.max_tables, memories=self.max_memories)

    def apply(self, store: Store) -> None:
        """Set these limits on a fresh store (before anything is instantiated in it)."""
        s = self.store_limits
        store.set_limits(memory_size=s.memory_size, table_elements=s.table_elements,
                         instances=s.instances, tables=s.tables, memories=s.memories)

    def memory_note(self) -> str:
        s = self.store_limits
        return f"memory limit: {s.memory_size / MIB:.1f} MiB per linear memory, {self.memory_bytes // MIB} MiB in all"

    def explain(self, wasmtime_message: str) -> str | None:
        """Which limit a wasmtime instantiation error hit, with its value; None if not a limit."""
        s = self.store_limits
        if m := re.search(r"(instance|memory|table) count too high at (\d+)", wasmtime_message):
            kind, what = {"instance": ("instances", "core wasm instances"), "memory": ("memories", "linear memories"),
                          "table": ("tables", "tables")}[m[1]]
            return (f"{kind} limit exceeded: the component creates at least {m[2]} {what}, "
                    f"the limit is {getattr(s, kind)}")
        if m := re.search(r"memory minimum size of (\d+) pages exceeds memory limits", wasmtime_message):
            need = int(m[1]) * WASM_PAGE
            return (f"memory limit exceeded: a linear memory starts at {need / MIB:.1f} MiB ({m[1]} pages), "
                    f"the limit is {s.memory_size / MIB:.1f} MiB per linear memory")
        if m := re.search(r"table minimum size of (\d+) elements exceeds table limits", wasmtime_message):
            return (f"table elements limit exceeded: a table starts at {m[1]} elements, "
                    f"the limit is {s.table_elements} elements per table")
        return None


class EpochOwner(Protocol):
    def on_epoch(self) -> str | None:
        """Called once per tick while the guest runs: a trap message to stop it, None to go on."""
        ...


_OWNERS: dict[int, EpochOwner] = {}
_keys = itertools.count(1)
_CB_TYPE = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
                            ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t))
_NO_FINALIZER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _data: None)


def _trap(message: str) -> int:
    return ctypes.cast(ffi.wasmtime_error_new(message.encode("utf-8")), ctypes.c_void_p).value or 0


@_CB_TYPE
def _on_epoch(_ctx, data, delta, kind):  # type: ignore[no-untyped-def]
    owner = _OWNERS.get(data or 0)
    if owner is None:
        return _trap("instance is gone")
    reason = owner.on_epoch()
    if reason is not None:
        return _trap(reason)
    delta[0] = 1
    kind[0] = 0  # continue
    return 0


def watch_epochs(store: Store, owner: EpochOwner) -> int:
    """Route `store`'s epoch deadlines to `owner.on_epoch`; returns the key for `unwatch_epochs`."""
    key = next(_keys)
    _OWNERS[key] = owner
    ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _on_epoch, key, _NO_FINALIZER)
    store.set_epoch_deadline(1)
    return key


def unwatch_epochs(key: int) -> None:
    _OWNERS.pop(key, None)
