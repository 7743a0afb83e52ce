"""What every WIT import shares: how guest misuse becomes a trap, and small argument checks.

Guest *bugs* trap the instance with a message naming the call and the bad value; *conditions*
come back as the WIT `result` error (the import returns a string). A host bug traps only the
calling guest, with the reason, and the host keeps serving.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import wasmtime

from host.state.pages import PageError
from host.wasm.instance import Instance, Terminated, current

if TYPE_CHECKING:
    from host.batching.future import ForwardFuture

__all__ = ["Begun", "GuestError", "Import", "WOULD_WAIT", "as_trap", "guest_import", "U32_MAX"]

log = logging.getLogger(__name__)

U32_MAX = 2**32 - 1

# An import as registered: called by wasmtime with the store context and the WIT arguments.
Import = Callable[..., Any]


class GuestError(Exception):
    """Guest misuse of an import: traps the instance with this message."""


WOULD_WAIT = object()  # what `Begun.finish(wait=False)` returns where finishing would wait


@dataclass(frozen=True)
class Begun:
    """An import begun without waiting (its `begin`, see `guest_import`): `fut`, the job its answer
    waits for (None: none); `finish(wait)`, its result once `fut` is done (raising as the import
    would; with `wait` False it returns `WOULD_WAIT` where it would have to wait, and the caller
    finishes it with `wait` True on the instance's thread); `abort`, what ends the job when the
    instance is terminated before it is done."""

    fut: ForwardFuture | None
    finish: Callable[[bool], Any]
    abort: Callable[[], None]

    @staticmethod
    def now(value: Any) -> Begun:
        """An import answered as it began: with `value`."""
        return Begun(None, lambda _wait: value, _nothing)


def _nothing() -> None:
    return None


def guest_import(name: str, store: bool = False, keeps_lookahead: bool = False,
                 before_launch: bool = False, begin: Callable[..., Begun | None] | None = None) \
        -> Callable[[Callable[..., Any]], Import]:
    """Wrap `fn(instance, *args)` as the import `name` (e.g. "kv.allocate"); with `store`,
    `fn(instance, store_context, *args)` (resource handles are resolved through the store).

    `before_launch`: the answer is the same for every launch, tenant and replica (a constant of
    the model), so a warm instance gets it while it warms, without parking (host/wasm/warm.py):
    the SDK asks for such constants before `runtime.arguments`, and they are off a launch's path.

    A `forward` or `kv` import drops a stepping guest's predicted next decode-step first (its view
    of its pages may change: host/api/lookahead.py) unless it is declared `keeps_lookahead`.

    `begin(instance, *args)`: the same import begun without waiting, for a caller that must not
    block (host/workers serves such calls on a worker's reader thread): its `Begun`, or None where
    beginning would wait (the caller then runs the import itself on the instance's thread). It
    raises as the import would; the wrapper keeps it as `.begin`."""

    drops = name.split(".", 1)[0] in ("forward", "kv") and not keeps_lookahead

    def deco(fn: Callable[..., Any]) -> Import:
        @functools.wraps(fn)
        def wrapper(_store: Any, *args: Any) -> Any:
            inst = current(park=not before_launch)
            try:
                if drops and inst.stepper is not None:  # its view of its pages may change: no lookahead
                    inst.stepper.drop()
                return fn(inst, _store, *args) if store else fn(inst, *args)
            except wasmtime.WasmtimeError:
                raise
            except Exception as e:
                raise as_trap(inst, name, e) from None

        # (host/workers: a worker answers such a constant itself)
        wrapper.before_launch = before_launch  # type: ignore[attr-defined]
        wrapper.begin = None  # type: ignore[attr-defined]
        if begin is not None:
            def begin_now(inst: Instance, *args: Any) -> Begun | None:
                if drops and inst.stepper is not None:
                    inst.stepper.drop()
                return begin(inst, *args)

            wrapper.begin = begin_now  # type: ignore[attr-defined]
        return wrapper

    return deco


def as_trap(inst: Instance, name: str, e: Exception) -> wasmtime.WasmtimeError:
    """The trap an import `name` that raised `e` ends its guest with (a guest's bug: the reason, kept
    as the instance's `trap_reason`; a host bug: logged, and said to be one)."""
    if isinstance(e, wasmtime.WasmtimeError):
        return e
    if isinstance(e, Terminated):
        return wasmtime.WasmtimeError(f"{name}: instance terminated: {e}")
    if isinstance(e, (GuestError, PageError, ValueError, TypeError, OverflowError)):
        return _trap(inst, f"{name}: {e}")
    log.error("host import %s failed", name, exc_info=e)
    return _trap(inst, f"{name}: internal host error: {type(e).__name__}: {e}")


def _trap(inst: Instance, reason: str) -> wasmtime.WasmtimeError:
    inst.trap_reason = reason
    return wasmtime.WasmtimeError(reason)


def timeout_s(timeout_ms: int | None) -> float | None:
    """A WIT `option<u32>` timeout in ms as seconds (None: wait forever)."""
    return None if timeout_ms is None else timeout_ms / 1000
