"""Background work at the lowest CPU priority: warm starts and store frees yield to running instances.

Why: a host that serves one burst right after another never goes idle, so work that waits for an
idle host (refilling the warm pool, freeing finished stores) never ran, and every launch paid a
cold start (bench/host_scale.py --back-to-back). Done at nice 19 instead, that work takes the CPU
the running instances leave (a 10 ms GPU step leaves most of it) and gives it back at once when
they want it: Linux schedules threads on their own and a thread's nice value is its own
(`setpriority` on its thread id).

A thread may always lower its own priority; raising it again, which a warm instance needs when it
is launched (from then on it serves a client), takes CAP_SYS_NICE or an RLIMIT_NICE that allows
it. `available()` probes that once; where it is not allowed, nothing is lowered and the host
keeps the rule before (background work waits for an idle host).
"""

from __future__ import annotations

import functools
import os
import threading

__all__ = ["BACKGROUND_NICE", "available", "lower", "restore"]

BACKGROUND_NICE = 19


@functools.cache
def available() -> bool:
    """Whether a thread lowered to `BACKGROUND_NICE` can be raised back here (probed on a thread of its own)."""
    ok: list[bool] = []

    def probe() -> None:
        base = lower()
        try:
            if base is not None:
                restore(threading.get_native_id(), base)
                ok.append(True)
        except OSError:
            pass

    t = threading.Thread(target=probe, name="pie-nice-probe")
    t.start()
    t.join()
    return bool(ok and ok[0])


def lower() -> int | None:
    """Move the calling thread to `BACKGROUND_NICE`; returns its nice value before (None: not possible)."""
    tid = threading.get_native_id()
    try:
        base = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, max(base, BACKGROUND_NICE))
    except (OSError, AttributeError):  # not Linux-like, or not permitted
        return None
    return base


def restore(native_id: int, nice: int) -> None:
    """Give thread `native_id` its nice value `nice` back (OSError if not permitted)."""
    os.setpriority(os.PRIO_PROCESS, native_id, nice)
