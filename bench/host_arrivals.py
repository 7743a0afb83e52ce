"""Do arriving requests stall the ones already generating? (issue 12: the launch grace)

Usage: python bench/host_arrivals.py --json OUT [--running 32] [--arrivals 40] [--every-ms 25] [--step-ms 10]
                                     [--quick]

`--running` `text_completion` instances (150 tokens) generate in front of the stand-in backend
sleeping `--step-ms` per batch (as in bench/host_scale.py); while they run, `--arrivals` short
ones (8 tokens) are launched, one every `--every-ms`. Reported for the running streams: the gap
between one backend call's end and the next one's start (mean, p99, max) while requests arrive,
against the same host's gaps with nothing arriving (`quiet_*`, measured first, same run), each
the median over `--reps` repetitions, warm pool (`warm`) and cold starts (`cold`, the pool off).
A host that held running batches for newcomers shows `gap_max_ms` of several ms (a stall of
every stream each time a request arrives); one that lets them join the next batch stays near quiet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import BatchLog, Run, compile_inferlet, percentile, settle

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig

PROMPT = "Write a story about a lighthouse."


def measure(opts: argparse.Namespace, warm: bool) -> dict[str, Any]:
    backend = StandInBackend(page_size=16, num_pages=16384, delay_s=opts.step_ms / 1000)
    log = BatchLog(backend)
    host = Host(HostConfig(warm_auto=256 if warm else 0), backend=backend, progress=False)
    long_args = ["--prompt", PROMPT, "--max-tokens", "150"]
    short_args = ["--prompt", PROMPT, "--max-tokens", "8"]
    quiet: list[list[float]] = []
    busy: list[list[float]] = []
    try:
        program = compile_inferlet(host, "text_completion")
        for k in range(opts.reps + 1):  # the first round is unmeasured (slots fault in, the pool learns)
            if warm and k:
                settle(host, program, opts.running)
            log.calls.clear()
            running = [Run(host, program, long_args) for _ in range(opts.running)]
            time.sleep(0.2)  # all running
            q0 = time.perf_counter()
            time.sleep(0.2)
            q1 = time.perf_counter()
            arrivals = []
            for _ in range(opts.arrivals):
                arrivals.append(Run(host, program, short_args))
                time.sleep(opts.every_ms / 1000)
            b1 = time.perf_counter()
            for r in running + arrivals:
                end = r.finish(600)
                if end.event != "completed":
                    raise RuntimeError(f"{end.event}: {end.message[:200]}")
            if k:
                quiet.append(log.gaps_ms(q0, q1))
                busy.append(log.gaps_ms(q1, b1))
    finally:
        host.shutdown()

    def med(fn: Any, runs: list[list[float]]) -> float:
        return round(statistics.median(fn(g) for g in runs), 3)

    return {"quiet_gap_mean_ms": med(statistics.mean, quiet), "quiet_gap_max_ms": med(max, quiet),
            "gap_mean_ms": med(statistics.mean, busy), "gap_p99_ms": med(lambda g: percentile(g, 0.99), busy),
            "gap_max_ms": med(max, busy)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--running", type=int, default=32, help="instances generating when the arrivals start")
    ap.add_argument("--arrivals", type=int, default=40, help="short requests launched while they run")
    ap.add_argument("--every-ms", type=float, default=25.0, help="time between two arrivals")
    ap.add_argument("--step-ms", type=float, default=10.0, help="stand-in backend time per batch")
    ap.add_argument("--reps", type=int, default=3, help="measured repetitions (medians reported)")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): 4 running, 5 arrivals, 1 repetition")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(running=4, arrivals=5, reps=1)
        opts = ap.parse_args()
    res: dict[str, Any] = {"running": opts.running, "arrivals": opts.arrivals, "every_ms": opts.every_ms,
                           "step_ms": opts.step_ms}
    for name, warm in (("warm", True), ("cold", False)):
        res[name] = measure(opts, warm)
        print(name, json.dumps(res[name]), flush=True)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
