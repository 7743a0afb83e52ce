"""Launch priority: while a scheduler launches a batch, instances' host calls wait for it.

The torch backend's `start_forward` on CUDA queues a batch's kernels and returns: an eager
prefill is hundreds of calls into torch, and each gives the GIL up. While a burst starts, the
instances' threads run host calls (the SDK's start: arguments, the chat template, encode, the
first forward), and every time the launching scheduler gave the GIL up one of them took it, so
each torch call waited for a host call to end or for a switch interval. On an H200 the first
batch of a burst, a prefill of 1-3 instances that launches in ~7 ms alone, took 130-300 ms
(bench/gpu_suite_notes.md), and the whole burst waited behind it: the device idled while the
host started instances one GIL turn at a time.

With `LaunchPriority`, a host call that begins while a launch is under way waits (without the
GIL) until the launch is done, for at most `max_wait_s`; a host call under way runs on. The
scheduler then launches at the speed it would alone, and the instances go on while the device
runs the batch. Only launches that return before the batch has run (a backend with
`start_forward`) are covered: a backend that runs the batch inside the call would hold the
instances back for the whole forward. `bench/host_scale.py --launch-ops` measures it with a
stand-in whose launch gives the GIL up as often as a torch launch does.
"""

from __future__ import annotations

import threading
from types import TracebackType

__all__ = ["LaunchPriority"]


class LaunchPriority:
    """`with priority:` around a launch; `wait()` at the start of each host call."""

    def __init__(self, enabled: bool = True, max_wait_s: float = 0.05) -> None:
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self._clear = threading.Event()  # set: no launch under way
        self._clear.set()
        self._launching = 0  # launches under way (one per scheduler: replicas launch at once)
        self._lock = threading.Lock()
        self.waits = 0  # host calls that waited for a launch (approximate: not under a lock)

    def __enter__(self) -> LaunchPriority:
        if self.enabled:
            with self._lock:
                self._launching += 1
                self._clear.clear()
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.enabled:
            with self._lock:
                self._launching -= 1
                if not self._launching:
                    self._clear.set()

    def launching(self) -> bool:
        return not self._clear.is_set()

    def wait(self) -> None:
        """A host call begins: if a launch is under way, wait until it is done (at most `max_wait_s`)."""
        if not self._clear.is_set():
            self.waits += 1
            self._clear.wait(self.max_wait_s)
