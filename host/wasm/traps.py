"""Why a guest ended, in words: a trap's wasmtime text turned into the message its client reads.

The host's own limits are named first (host/wasm/limits.py, pooling.py), then wasmtime's root
cause, the guest's stderr tail and a short backtrace; a Python guest's MemoryError is told as
the memory limit that refused its heap.
"""

from __future__ import annotations

import re

from host.wasm.limits import InstanceLimits
from host.wasm.pooling import PoolingConfig

__all__ = ["explain_trap", "memory_note", "split_wasmtime_error"]

_BACKTRACE_FRAMES = 8


def explain_trap(text: str, limits: InstanceLimits, pooling: PoolingConfig | None, stderr: str) -> tuple[str, bool]:
    """The end message of a guest that trapped with wasmtime error `text`, and whether the host,
    not the guest, is at fault (the pool's slots ran out)."""
    cause, backtrace = split_wasmtime_error(text)
    limit = limits.explain(cause)
    if limit is None and pooling is not None:
        limit = pooling.explain(cause)
        if limit is not None:
            return limit, True
    if limit is not None:
        return limit, False
    stderr = stderr.strip()
    first = f"trap: {cause}{memory_note(stderr, limits)}"
    detail = f"\n{stderr[-2000:]}" if stderr else ""
    frames = f"\nwasm backtrace:\n{backtrace}" if backtrace else ""
    return f"{first}{detail}{frames}", False


def memory_note(guest_output: str, limits: InstanceLimits) -> str:
    """" (memory limit ...)" when the guest's last words are a Python MemoryError: its heap
    could not grow, which in wasm means the memory limit refused it. Else ""."""
    lines = guest_output.strip().splitlines()
    if lines and lines[-1].startswith("MemoryError"):
        return f" ({limits.memory_note()})"
    return ""


def split_wasmtime_error(text: str) -> tuple[str, str]:
    """wasmtime's error text as (cause, backtrace).

    A trap reads "error while executing at wasm backtrace: <frames> Caused by: <causes>", the
    causes outermost first ("0: ...", "1: ..."). The cause is those joined by ": " (after the
    first line when that is not the backtrace header, as in anyhow's "outer: inner"), or the
    first line alone when there is no "Caused by:" section. At most 8 frames are kept.
    """
    head, sep, tail = text.strip().partition("\nCaused by:")
    head_lines = [ln.strip() for ln in head.splitlines() if ln.strip()] or ["trap"]
    if not sep:
        return head_lines[0], ""
    causes = [re.sub(r"^\d+: ", "", ln.strip()) for ln in tail.splitlines() if ln.strip()]
    has_frames = head_lines[0].startswith("error while executing")
    frames = head_lines[1:] if has_frames else []
    causes = causes if has_frames else head_lines[:1] + causes
    if len(frames) > _BACKTRACE_FRAMES:
        frames = frames[:_BACKTRACE_FRAMES] + [f"... {len(frames) - _BACKTRACE_FRAMES} more frames"]
    return ": ".join(causes) or "trap", "\n".join(f"  {f}" for f in frames)
