"""Counting the instances that are starting, so background work can wait for them: `Starts`.

Why: a burst's instances are its critical path until each has queued its first forward (the
backend's batches fill no faster), and the work that can wait, the warm pool's refills and the
reaper's frees (host/wasm/warm.py, reaper.py), should not take the cores and the GIL from them.
That work waits while `Starts.active()`, looking again every `START_POLL_S` for at most
`START_MAX_WAIT_S`. Measured (bench/HISTORY.md, "Issue 40, second round"): 33-76 of the last
burst's frees ran inside each ramp of 256 before, 1-9 after; burst efficiency on 2 vCPUs moved
within the noise.
"""

from __future__ import annotations

import threading

__all__ = ["START_MAX_WAIT_S", "START_POLL_S", "Starts"]

START_POLL_S = 0.002  # how often work that waits for `Starts` looks again
START_MAX_WAIT_S = 0.25  # and the longest it waits (a guest computing before its first call, sustained load)


class Starts:
    """How many launched instances are starting: between their launch and their first wait (the
    first forward of most inferlets) or their end."""

    def __init__(self) -> None:
        self._n = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        with self._lock:
            self._n += 1

    def done(self) -> None:
        with self._lock:
            self._n -= 1

    def active(self) -> bool:
        return self._n > 0
