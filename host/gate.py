"""The run gate: instance threads take turns instead of fighting over the GIL.

After a batch returns, every instance of the batch wakes at once. Each then runs a little host
code (convert the result, later the next request) and guest code (the SDK's loop). Python
hands the GIL over at every ctypes call, and a step of one instance makes dozens, so 16
threads woken together pass the GIL back and forth hundreds of times per step, each pass a
futex wake and a context switch, all on caches the backend has just flushed. Letting one
instance thread run at a time (it gives the gate up whenever it blocks) costs no parallelism
the GIL had not already taken away and removes the ping-pong: measured with
bench/host_overhead.py (`--no-gate` for the comparison).

The gate never stops anyone for long: a thread waits for it only while the holder keeps
moving. When one holder has held it longer than `max_hold_s` (a guest computing, or sleeping
in WASI where the host cannot see it) the others go ahead without it, and the epoch callback
makes a guest that runs that long give the gate up.
"""

from __future__ import annotations

import threading
import time

__all__ = ["RunGate"]


class RunGate:
    """A lock an instance thread holds while it runs, released whenever it blocks."""

    def __init__(self, enabled: bool = True, max_hold_s: float = 0.02) -> None:
        self.enabled = enabled
        self.max_hold_s = max_hold_s
        self._lock = threading.Lock()
        self._since = 0.0  # when the current holder took the gate
        self._mine = threading.local()

    def enter(self) -> None:
        """Take the gate (a thread that already holds it keeps it); gives up on a stuck holder."""
        if not self.enabled or getattr(self._mine, "held", False):
            return
        lock = self._lock
        while not lock.acquire(timeout=0.002):
            if time.perf_counter() - self._since > self.max_hold_s:
                return  # the holder is busy for long: run without the gate this time
        self._since = time.perf_counter()
        self._mine.held = True

    def leave(self) -> None:
        """Give the gate up if this thread holds it."""
        mine = self._mine
        if getattr(mine, "held", False):
            mine.held = False
            self._lock.release()

    def held(self) -> bool:
        return bool(getattr(self._mine, "held", False))
