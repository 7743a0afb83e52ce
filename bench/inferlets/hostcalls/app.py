"""Benchmark inferlet: times host-call round trips from inside the guest.

args: empty N | forward N | decode N (forward.decode-step). Returns the mean microseconds per call, measured in the guest.
"""

from __future__ import annotations

import time

from inferlet import _host


def main(args: list[str]) -> str:
    mode, n = args[0], int(args[1])
    if mode == "empty":
        rt = _host.runtime
        t0 = time.perf_counter_ns()
        for _ in range(n):
            rt.elapsed_ms()
        dt = time.perf_counter_ns() - t0
    elif mode == "forward":
        fwd = _host.forward
        page = list(_host.kv.allocate(1))
        spec = [fwd.OutputSpec(index=0, sample=fwd.Sampler(0.0, 0, 1.0, 0.0, None), dist=0)]
        fwd.run(page, 1, [5], [0], [], spec)  # warm up
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fwd.run(page, 1, [5], [0], [], spec)  # rewrites slot 0: a 1-token pass over 1 token
        dt = time.perf_counter_ns() - t0
        _host.kv.release(page)
    elif mode == "decode":
        fwd = _host.forward
        page = list(_host.kv.allocate(1))
        sampler = fwd.Sampler(0.0, 0, 1.0, 0.0, None)
        fwd.decode_step(page, 1, 5, 0, sampler)  # warm up
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fwd.decode_step(page, 1, 5, 0, sampler)
        dt = time.perf_counter_ns() - t0
        _host.kv.release(page)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    return f"{dt / n / 1000:.2f}"
