"""Per-instance limits and the epoch callback that enforces them on running guest code.

wasmtime calls the epoch deadline callback on the instance's own thread each time the guest's
deadline passes, i.e. once per epoch tick while wasm code runs. It traps the guest when the
owner says so (terminated, over its wall-clock budget) and otherwise extends the deadline by one
tick. Lowering a deadline from another thread does not work: compiled code caches the deadline,
so the callback is the only prompt way to stop a spinning guest.
"""

from __future__ import annotations

import ctypes
import itertools
from dataclasses import dataclass
from typing import Protocol

from wasmtime import Store
from wasmtime import _ffi as ffi

__all__ = ["EpochOwner", "InstanceLimits", "watch_epochs", "unwatch_epochs"]


@dataclass(frozen=True)
class InstanceLimits:
    """memory_bytes: linear memory cap; wall_budget_s: wall-clock budget (None = unlimited)."""

    memory_bytes: int = 512 * 2**20
    wall_budget_s: float | None = None


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
