"""How long a burst takes to reach the backend, by run-gate setting (diagnosis for issue 12).

Usage: python bench/host_ramp.py --json OUT [--instances 64] [--bursts 5] [--step-ms 10] [--settings ...]
                                 [--cores 1 all] [--rounds 1] [--quick]

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

`--cores`: each setting is measured with the whole process (every thread, and so every thread
it starts) confined to the first k of the CPUs it may use, for each k given (`all`: no limit),
on a host of its own; `--rounds R` repeats the list R times in alternation, and each entry
reports the median over rounds of the bursts' medians (`by_round`: each round's). `ramp_cpu_ms`:
the process's CPU time from the first launch to the full batch, and `ramp_cores` that over
full_batch_ms, the cores the ramp kept busy. Whether a burst's starts proceed in parallel on
more cores reads from full_batch_ms at 1 core against all of them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import time
from pathlib import Path
from typing import Any

from common import BatchLog, Run, compile_inferlet, settle

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig

ARGS = ["--prompt", "Write a story about a lighthouse.", "--max-tokens", "64"]
SETTINGS: dict[str, dict[str, Any]] = {"default": {}, "slots1": {"run_slots": 1}, "slots2": {"run_slots": 2}, "slots4": {"run_slots": 4},
            "no_gate": {"run_gate": False}, "python_gc": {"tune_gc": False}, "no_ahead": {"run_ahead": False}}


def measure(setting: dict[str, Any], n: int, bursts: int, step_s: float) -> dict[str, Any]:
    backend = StandInBackend(page_size=16, num_pages=16384, delay_s=step_s)
    log = BatchLog(backend)
    host = Host(HostConfig(**setting), backend=backend, progress=False)
    effs, firsts, fulls, gaps, faults, switches, ramp_cpu = [], [], [], [], [], [], []
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
            log.cpu_at_start.clear()
            pauses.clear()
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            cpu0 = time.process_time()
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
                full = next(start for start, _, size in sorted(log.calls) if size >= 0.9 * n)
                fulls.append(1000 * (full - t0))
                ramp_cpu.append(1000 * (dict(log.cpu_at_start)[full] - cpu0))
                gaps.append(statistics.median(log.gaps_ms()))
    finally:
        gc.callbacks.remove(on_gc)
        host.shutdown()
    return {"efficiency": round(statistics.median(effs), 3), "first_batch_ms": round(statistics.median(firsts), 1),
            "full_batch_ms": round(statistics.median(fulls), 1), "ramp_cpu_ms": round(statistics.median(ramp_cpu), 1),
            "ramp_cores": round(statistics.median(c / f for c, f in zip(ramp_cpu, fulls, strict=True)), 2), "gap_ms": round(statistics.median(gaps), 2), "minflt": statistics.median(faults),
            "nvcsw": statistics.median(switches), "gc_ms": round(statistics.median(gc_totals), 1),
            "gc_max_ms": round(gc_max, 1), "efficiencies": [round(e, 3) for e in effs]}


def confine(cpus: set[int]) -> None:
    """Every thread of this process on `cpus` (threads started later inherit their starter's set)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):  # a thread that has just ended
            pass


def median_entry(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's median over the rounds (lists: the first round's)."""
    out: dict[str, Any] = {}
    for key, value in rounds[0].items():
        if isinstance(value, (int, float)):
            out[key] = round(statistics.median(r[key] for r in rounds), 3)
        else:
            out[key] = value
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--cores", nargs="+", default=["all"], metavar="K",
                    help="confine the process to the first K of its CPUs (a number, or all), each in turn")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the settings x cores list, alternating")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): 8 instances, 1 burst")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=8, bursts=1)
        opts = ap.parse_args()
    if opts.rounds < 1 or opts.bursts < 1 or opts.instances < 1:
        ap.error("--rounds, --bursts and --instances must be at least 1")
    allowed = sorted(os.sched_getaffinity(0))
    cores: list[int] = []
    for k in opts.cores:
        if k == "all":
            cores.append(len(allowed))
        elif k.isdigit() and 1 <= int(k) <= len(allowed):
            cores.append(int(k))
        else:
            ap.error(f"--cores: {k!r} is not 'all' or a number from 1 to {len(allowed)} (the CPUs this process may use)")
    res: dict[str, Any] = {"instances": opts.instances, "step_ms": opts.step_ms, "cpus": len(allowed)}
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for _ in range(opts.rounds):
            for name in opts.settings:
                for k in cores:
                    key = name if opts.cores == ["all"] else f"{name}@{k}"
                    confine(set(allowed[:k]))
                    runs.setdefault(key, []).append(measure(SETTINGS[name], opts.instances, opts.bursts, opts.step_ms / 1000))
                    print(key, json.dumps(runs[key][-1]), flush=True)
    finally:
        confine(set(allowed))
    for key, rounds in runs.items():
        res[key] = median_entry(rounds) if len(rounds) > 1 else rounds[0]
        if len(rounds) > 1:
            res[key]["by_round"] = rounds
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
