"""What a cold launch costs the launching thread (pie-serve's asyncio loop), with the starter
(host/wasm/starter.py: the instance's thread is started on the starter's thread) and without it
(`inline`: `Host.launch` starts the thread itself, as before), alternated on hosts of their own.

Usage: python bench/cold_launch.py --json bench/cold_launch.json [--instances 128] [--rounds 4] [--quick]

A burst of `--instances` `text_completion` launches with the warm pool off (every launch cold;
a pool that has run dry, or a program not among the recent ones), 64 tokens each on the stand-in
backend at a 10 ms step. Per round: the launching thread's time per launch (median, p99, max:
how long an event loop making the launches stops serving its other clients), its total for the
burst, and the burst's efficiency (tok/s over the stand-in's ideal, as bench/host_scale.py).
Reported: per mode, the median over rounds of each number. Outputs are checked.
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import Run, percentile
from host_scale import expected_text, inferlet_wasm, make_host, workload_args

from host import Host
from host.wasm import starter as starter_module

STEP_S = 0.010
TOKENS = 64


@contextlib.contextmanager
def mode(name: str) -> Iterator[None]:
    """`inline`: the starter starts each thread on the caller's thread (the host before it)."""
    saved = starter_module.Starter.start_soon
    if name == "inline":
        starter_module.Starter.start_soon = lambda self, inst: inst.start()  # type: ignore[method-assign]
    try:
        yield
    finally:
        starter_module.Starter.start_soon = saved  # type: ignore[method-assign]


def burst(host: Host, program: str, n: int, want: str) -> dict[str, float]:
    args = workload_args("app", TOKENS)
    per_launch = []
    t0 = time.perf_counter()
    runs = []
    for _ in range(n):
        a = time.perf_counter()
        runs.append(Run(host, program, args))
        per_launch.append(time.perf_counter() - a)
    launched = time.perf_counter() - t0
    for r in runs:
        end = r.finish(600)
        if end.event != "completed" or end.message != want:
            raise RuntimeError(f"wrong result: {end.event}: {end.message[:200]!r}")
    wall = time.perf_counter() - t0
    ideal = n * TOKENS / ((TOKENS + 1) * STEP_S)
    return {"launch_median_us": round(1e6 * statistics.median(per_launch), 1),
            "launch_p99_us": round(1e6 * percentile(per_launch, 0.99), 1),
            "launch_max_us": round(1e6 * max(per_launch), 1),
            "launch_total_ms": round(1000 * launched, 1),
            "efficiency": round(n * TOKENS / wall / ideal, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--instances", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): 8 instances, 2 rounds")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=8, rounds=2)
        opts = ap.parse_args()
    opts.inferlets = None
    wasm = inferlet_wasm(opts, "text_completion")
    rounds: dict[str, list[dict[str, float]]] = {"starter": [], "inline": []}
    for r in range(opts.rounds):
        for name in (("starter", "inline") if r % 2 == 0 else ("inline", "starter")):
            with mode(name):
                host = make_host("inproc", STEP_S, warm_auto=0, run_ahead=True)
                try:
                    program = host.compile(wasm)
                    want = expected_text(host, TOKENS)
                    burst(host, program, opts.instances, want)  # unmeasured: the pool slots' first use
                    time.sleep(1.0)
                    rounds[name].append(burst(host, program, opts.instances, want))
                finally:
                    host.shutdown()
            print(name, rounds[name][-1], flush=True)
    result: dict[str, Any] = {
        "instances": opts.instances, "rounds": opts.rounds,
        "modes": {name: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for name, rs in rounds.items()},
        "all": rounds}
    opts.json.write_text(json.dumps(result, indent=1))
    keys = list(result["modes"]["starter"])
    lines = [f"# bench/cold_launch.py ({opts.instances} cold `text_completion` launches, 10 ms stand-in step, "
             f"medians of {opts.rounds} rounds)", "", "| mode | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for name, m in result["modes"].items():
        lines.append(f"| {name} | " + " | ".join(str(round(m[k], 3)) for k in keys) + " |")
    opts.json.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
