"""How long a burst takes to reach the backend, by run-gate setting (diagnosis for issue 12).

Usage: python bench/host_ramp.py --json OUT [--instances 64] [--bursts 5] [--step-ms 10] [--settings ...]

N `text_completion` instances (greedy, 64 tokens) launched at once in front of the stand-in backend
sleeping `--step-ms` per batch, as in bench/host_scale.py, with the host as it runs by default
(the warm pool refilled and the host settled before each burst: bench/common.settle). For each
run-gate setting (`run_slots` 1, 2, 4 and the gate off) it reports the median over `--bursts` of
the efficiency (tok/s / ideal) and of `first_batch_ms`: from the first launch to the first backend
call. The policy holds that call until the launched instances have submitted, so first_batch_ms
is the ramp: the guest and host work each instance does before its first forward, serialized.
`full_batch_ms`: from the first launch to the first backend call with at least 90% of the N
instances in it (when the last ones have joined). `gap_ms`: the median time from one backend call's end to the next one's start (the host's own work
per step once the instances run). `minflt` / `nvcsw`: the process's minor page faults and voluntary
context switches during the burst (getrusage), e.g. pool slots faulting in or threads waking to poll.
`gc_ms`: the median over bursts of the time Python's cyclic GC stopped the process during a burst
(gc.callbacks), `gc_max_ms` the longest single collection in any burst; `python_gc` is the
default host with `tune_gc` off (HostConfig: Python's own GC settings, nothing frozen), and
`no_ahead` the default host with `run_ahead` off (every loop's step made between two backend calls).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from common import BatchLog, Run, compile_inferlet, settle

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig

ARGS = ["--prompt", "Write a story about a lighthouse.", "--max-tokens", "64"]
SETTINGS = {"default": {}, "slots1": {"run_slots": 1}, "slots2": {"run_slots": 2}, "slots4": {"run_slots": 4},
            "no_gate": {"run_gate": False}, "python_gc": {"tune_gc": False}, "no_ahead": {"run_ahead": False}}


def measure(setting: dict[str, Any], n: int, bursts: int, step_s: float) -> dict[str, Any]:
    backend = StandInBackend(page_size=16, num_pages=16384, delay_s=step_s)
    log = BatchLog(backend)
    host = Host(HostConfig(**setting), backend=backend, progress=False)
    effs, firsts, fulls, gaps, faults, switches = [], [], [], [], [], []
    pauses: list[float] = []  # GC pauses of the current burst
    gc_totals: list[float] = []
    gc_max = 0.0
    gc_start = [0.0]

    def on_gc(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - gc_start[0])

    gc.callbacks.append(on_gc)
    try:
        program = compile_inferlet(host, "text_completion")
        for k in range(bursts + 1):  # the first burst is unmeasured: the pool learns n, slots fault in
            if k:
                settle(host, program, n)
            log.calls.clear()
            pauses.clear()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            runs = [Run(host, program, ARGS) for _ in range(n)]
            for r in runs:
                end = r.finish(600)
                if end.event != "completed":
                    raise RuntimeError(f"{end.event}: {end.message[:200]}")
            wall = time.perf_counter() - t0
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            if k:
                gc_totals.append(1000 * sum(pauses))
                gc_max = max([gc_max, *(1000 * p for p in pauses)])
                faults.append(ru1.ru_minflt - ru0.ru_minflt)
                switches.append(ru1.ru_nvcsw - ru0.ru_nvcsw)
                effs.append(n * 64 / wall / (n * 64 / (65 * step_s)))
                firsts.append(1000 * (log.calls[0][0] - t0))
                fulls.append(1000 * (next(start for start, _, size in log.calls if size >= 0.9 * n) - t0))
                gaps.append(statistics.median(log.gaps_ms()))
    finally:
        gc.callbacks.remove(on_gc)
        host.shutdown()
    return {"efficiency": round(statistics.median(effs), 3), "first_batch_ms": round(statistics.median(firsts), 1),
            "full_batch_ms": round(statistics.median(fulls), 1), "gap_ms": round(statistics.median(gaps), 2), "minflt": statistics.median(faults),
            "nvcsw": statistics.median(switches), "gc_ms": round(statistics.median(gc_totals), 1),
            "gc_max_ms": round(gc_max, 1), "efficiencies": [round(e, 3) for e in effs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    opts = ap.parse_args()
    res: dict[str, Any] = {"instances": opts.instances, "step_ms": opts.step_ms}
    for name in opts.settings:
        res[name] = measure(SETTINGS[name], opts.instances, opts.bursts, opts.step_ms / 1000)
        print(name, json.dumps(res[name]), flush=True)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
