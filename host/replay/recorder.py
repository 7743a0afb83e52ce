"""Recording an instance's host calls: `Recorder`, and the tap that feeds it.

Every WIT import of our world is registered through host/api/fastcall.py's `add_func`, in the
host's linker and in each worker's (host/workers/worker.py: its stubs, its local imports and the
model's constants). While at least one recorder is tapped (`Recorder.tap`), fastcall hands each
call to `_tap`, which looks up the calling thread's instance: one whose `recorder` is set has the
call's name, arguments and outcome (its result, or the text of the trap it raised) appended, in
the order the guest made them. While none is, a call pays one global read. The host's
`wasi:clocks/monotonic-clock` (host/api/wasi.py) is recorded too, as "monotonic-clock.now" etc.: a
guest that reads the time replays the times it read; a subscription's pollable (wasmtime's own
resource, ready once the wait is over) is recorded as None. The rest of WASI (the wall clock,
output, randomness) and resource drops are not recorded: they are not `add_func` functions.

A recording is bounded (`max_bytes`, `HostConfig.max_recording_bytes`): the call that would pass
the bound is not kept, the recording is marked truncated and stops growing; the instance runs on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import wasmtime
from wasmtime.component import ResourceAny

from host.api import fastcall
from host.replay import format as fmt
from host.wasm.calling import calling
from host.workers import wire

__all__ = ["MAX_RECORDING_BYTES", "PIECE_BYTES", "Recorder"]

MAX_RECORDING_BYTES = 64 * 2**20
PIECE_BYTES = 1 << 20  # a worker sends its recording in pieces of at most this (wire.Recorded)

_CALL = b"\x94"  # msgpack: an array of 4 (name, args, ok, value)
_OK, _TRAP = b"\xc3", b"\xc2"  # msgpack true, false


class Recorder:
    """One instance's recording: its calls, encoded as they are made, and the `header` of its file
    (program, arguments, tenant, ...: host/replay/format.py)."""

    def __init__(self, max_bytes: int = MAX_RECORDING_BYTES, header: dict[str, Any] | None = None) -> None:
        if max_bytes < 1:
            raise ValueError(f"a recording's bound must be >= 1 byte, got {max_bytes}")
        self.max_bytes = max_bytes
        self.header = dict(header or {})
        self.size = 0  # bytes of the calls kept
        self.count = 0  # calls kept
        self.truncated = False
        self._parts: list[bytes] = []
        self._tapped = False

    # ---- recording ----
    def call(self, name: str, fn: Callable[..., Any], store: Any, args: list[Any]) -> Any:
        """Run import `fn` for the guest and record the call (the tap's work for a recorded instance)."""
        if self.truncated:
            return fn(store, *args)
        # A guest's handle resolves once (a second `to_host` fails): resolved here, the import gets
        # its rep as a worker's host does (wire.RemoteHandle), and the recording that rep.
        args = [_resolved(a, store) if type(a) is ResourceAny else a for a in args]
        try:
            encoded = wire.dumps(args, store)
        except wire.WireError as e:  # (the call itself fails the same way, or the import explains it)
            encoded = wire.dumps([f"<arguments not recordable: {e}>"])
        try:
            result = fn(store, *args)
        except wasmtime.WasmtimeError as e:
            self._add(name, encoded, False, str(e))
            raise
        except Exception as e:  # (an import's host bug: the guest traps with it)
            self._add(name, encoded, False, f"{type(e).__name__}: {e}")
            raise
        self._add(name, encoded, True, result)
        return result

    def _add(self, name: str, args: bytes, ok: bool, value: Any) -> None:
        if type(value) is ResourceAny:  # a WASI pollable: the replay makes its own (host/replay/replay.py)
            value = None
        try:
            out = wire.dumps(value)
        except wire.WireError as e:
            out = wire.dumps(f"<result not recordable: {e}>")
        entry = b"".join((_CALL, wire.dumps(name), args, _OK if ok else _TRAP, out))
        if self.size + len(entry) > self.max_bytes:
            self.truncated = True
            return
        self._parts.append(entry)
        self.size += len(entry)
        self.count += 1

    # ---- across processes (a worker's guest: host/workers/) ----
    def pieces(self) -> Iterator[tuple[bytes, int]]:
        """The calls kept, as (bytes, calls ending in them) in pieces of at most `PIECE_BYTES`
        (at least one piece, empty for none)."""
        blob = b"".join(self._parts)
        n = max(1, -(-len(blob) // PIECE_BYTES))
        for i in range(n):
            yield blob[i * PIECE_BYTES:(i + 1) * PIECE_BYTES], self.count if i == n - 1 else 0

    def extend(self, calls: bytes, count: int, truncated: bool) -> None:
        """Append a piece of calls recorded elsewhere (`wire.Recorded`). Pieces past the bound (only
        a worker not ours sends them) leave an empty, truncated recording, not a partial call."""
        if self.size + len(calls) > self.max_bytes or count < 0:
            self._parts, self.size, self.count, self.truncated = [], 0, 0, True
            return
        if calls:
            self._parts.append(calls)
            self.size += len(calls)
        self.count += count
        self.truncated = self.truncated or truncated

    # ---- the file ----
    def finish(self, event: str, message: str) -> bytes:
        """The recording file, its instance having ended with (`event`, `message`); stops the tap."""
        self.untap()
        return fmt.encode(self.header, b"".join(self._parts), self.count, (event, message), self.truncated)

    # ---- the tap ----
    def tap(self) -> None:
        """Have calls in this process looked at from now on (until `untap` or `finish`)."""
        global _taps
        with _taps_lock:
            if not self._tapped:
                self._tapped = True
                _taps += 1
                fastcall.set_tap(_tap)

    def untap(self) -> None:
        global _taps
        with _taps_lock:
            if self._tapped:
                self._tapped = False
                _taps -= 1
                if _taps == 0:
                    fastcall.set_tap(None)


_taps = 0  # recorders tapped in this process
_taps_lock = threading.Lock()


def _resolved(handle: ResourceAny, store: Any) -> Any:
    try:
        return wire.RemoteHandle(handle.to_host(store).rep)
    except wasmtime.WasmtimeError:  # (not a handle of this store: the import says so)
        return handle


def _tap(name: str, fn: Callable[..., Any], store: Any, args: list[Any]) -> Any:
    """fastcall's hook while some recorder is tapped: record the call if its instance records."""
    inst = getattr(calling, "instance", None)
    rec = None if inst is None else inst.recorder
    if rec is None:
        return fn(store, *args)
    return rec.call(name, fn, store, args)
