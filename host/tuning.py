"""Process-wide settings a host changes while it runs, given back when the last one shuts down:
the garbage collector (start-up objects frozen, young collections rarer, a full one when idle),
the GIL switch interval, and how many background threads the warm pool and the reaper get.
"""

from __future__ import annotations

import gc
import os
import sys
import threading

__all__ = ["ProcessTuning", "background_threads", "collect_when_idle", "restore_switch_interval",
           "set_switch_interval", "tune_gc", "untune_gc"]

_CUDA_SWITCH_MS = 0.5  # HostConfig.switch_interval_ms's default on a CUDA backend

_YOUNG_GC_THRESHOLD = 10_000  # net allocations between two young collections (Python's default: 700)
_tuning_lock = threading.Lock()  # the process-wide settings hosts change (GC, GIL switch interval)
_gc_hosts = 0  # hosts alive with tune_gc; the first tunes the collector, the last one out restores it
_gc_before = (700, 10, 10)



def background_threads() -> int:
    """Threads for the warm pool's starts and for the reaper's frees each: one per four cores this
    process may use, at least one, at most four. Both run wasmtime without the GIL (instantiation,
    a slot's reset), so on a GPU host's cores a burst's refills and frees proceed in parallel; on a
    small machine one thread each leaves the cores to the running instances."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(4, cores // 4))


def tune_gc() -> None:
    """Collect once, freeze every object alive and collect the young generation less often.

    A started host holds ~190k objects (torch, the tokenizer, modules) that live as long as it
    does, and each full (generation 2) collection scanned them all: 100-150 ms with every thread
    stopped, about once a second while bursts of instances came and went (bench/HISTORY.md,
    `gc_max_ms`). Frozen, they are never scanned again. With the young generation collected every
    700 net allocations, a burst of 256 `text_completion` instances made ~70 young and ~7 middle
    collections and, frozen, a full one of 14-90 ms over the objects made since; at 10,000 it
    makes 1-2 young ones (~2.5 ms) and no full one. A serving process keeps its start-up
    objects anyway; cyclic garbage waits a little longer to be collected."""
    global _gc_hosts, _gc_before
    with _tuning_lock:
        if _gc_hosts == 0:
            _gc_before = gc.get_threshold()
        _gc_hosts += 1
        gc.collect()
        gc.freeze()
        gc.set_threshold(max(_gc_before[0], _YOUNG_GC_THRESHOLD), _gc_before[1], _gc_before[2])


def collect_when_idle() -> None:
    """The warm pool has just refilled, i.e. the host is idle (refills wait for quiet): collect
    fully now, while nothing waits for the GIL.

    Frozen, the start-up objects are out of every collection; what a full collection still scans
    is what came after, chiefly the parked instances' objects (~50k for 256 of them). Left to the
    collector, the middle generation, every 10th young collection, came due inside a burst now and
    then (2 of 7 bursts of 256 paused 16 and 36 ms, every thread stopped) and a full one after 10
    of those. Collected here (17-36 ms, idle), each burst starts with the counts at zero and the
    pool's objects in the oldest generation: a burst of 256 then makes only 1-2 young collections
    (2-4 ms in all)."""
    gc.collect()


def untune_gc() -> None:
    """A tuned host has shut down: with no other left, what they left behind can be collected
    again and the collector runs as before."""
    global _gc_hosts
    with _tuning_lock:
        _gc_hosts -= 1
        if _gc_hosts == 0:
            gc.unfreeze()
            gc.set_threshold(*_gc_before)


_switch_hosts: list[float] = []  # the interval each host alive with one set found (the first's is restored)


def set_switch_interval(ms: float) -> None:
    """The GIL switch interval while a host runs (`HostConfig.switch_interval_ms`); the last set wins."""
    with _tuning_lock:
        _switch_hosts.append(sys.getswitchinterval())
        sys.setswitchinterval(ms / 1000)


def restore_switch_interval() -> None:
    with _tuning_lock:
        before = _switch_hosts.pop()
        if not _switch_hosts:
            sys.setswitchinterval(before)


class ProcessTuning:
    """What one host changed in its process (`HostConfig.tune_gc`, `switch_interval_ms`), undone by
    `restore` at its shutdown."""

    def __init__(self, gc_tuned: bool, switch_interval_ms: float | None, device: str) -> None:
        self.gc_tuned = gc_tuned
        if gc_tuned:
            tune_gc()
        if switch_interval_ms is None:  # the short interval where it was measured to help: a CUDA backend
            switch_interval_ms = _CUDA_SWITCH_MS if device.startswith("cuda") else 0.0
        self.switch_interval_ms = switch_interval_ms  # what this host set (0: Python's own)
        if switch_interval_ms > 0:
            set_switch_interval(switch_interval_ms)

    def restore(self) -> None:
        if self.gc_tuned:
            untune_gc()
        if self.switch_interval_ms > 0:
            restore_switch_interval()
