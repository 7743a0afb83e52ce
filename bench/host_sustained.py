"""Sustained load: N `text_completion` instances kept running, each replaced as soon as it ends.

Usage: python bench/host_sustained.py --json OUT [--instances 64 256] [--step-ms 10] [--tokens 64]
                                      [--warmup-s 20] [--measure-s 6] [--policies queue behind inline] [--quick]

bench/host_scale.py measures bursts: N launches at an idle host, timed to the last end. A server
under steady traffic never goes idle, so what it defers "until the host is idle" (freeing finished
instances' stores, host/wasm/reaper.py; refilling the warm pool, host/wasm/warm.py) must keep
pace with the ends instead. Here a launcher keeps N instances running in front of the stand-in
backend (gpu_backend/standin.py, `--step-ms` per batch, deterministic tokens: every output is
checked); after `--warmup-s` (the pool's slots are used for the first time then: host/wasm/reaper.py)
it counts the tokens the backend sampled within `--measure-s` (the scheduler's forwards: one token
each; counting completed instances instead is off by up to N when their ends come in clusters).
tok_s = tokens / window; ideal_tok_s = N * tokens / ((tokens + 1) * step), as in host_scale (so at
most 65/64 is reachable: the host needs 64 forwards, not 65, for 64 tokens); efficiency = tok_s /
ideal_tok_s.
Also per completion: the process's CPU ms and minor page faults; `refused`: launches that ended in
an error (e.g. the instance pool full) over the whole run; `max_pending`: the most stores waiting
in the reaper's queue at a 1 s sample.

Each entry is run under each store-freeing policy, each on a fresh host, in the same run:
- `queue`: the rule before this bench existed: the reaper's thread frees every store, while the
  backend is idle or once the store has waited 1 s;
- `behind`: the host's default: as `queue` (0.25 s), but an ending instance frees its own store
  when the reaper is behind;
- `inline`: every ending instance frees its own store (no reaper).
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import queue
import resource
import threading
import time
from pathlib import Path
from typing import Any

from common import compile_inferlet, settle
from host_scale import expected_text, make_host, workload_args

from host import Host, InstanceEvent

POLICIES = ("queue", "behind", "inline")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--instances", type=int, nargs="+", default=[64, 256], help="instances kept running")
    ap.add_argument("--step-ms", type=float, default=10.0, help="backend time per batch")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per instance")
    ap.add_argument("--warmup-s", type=float, default=20.0,
                    help="load before the measured window (at 256 the first ~15-20 s pay the pool slots' first use)")
    ap.add_argument("--measure-s", type=float, default=6.0, help="the measured window")
    ap.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                    help="store-freeing policies to compare (see the module doc)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 8 instances, 16 tokens, 1 s warm-up, a 1 s window")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=[8], tokens=16, warmup_s=1.0, measure_s=1.0)
        opts = ap.parse_args()
    return opts


def set_policy(host: Host, policy: str) -> None:
    reaper = host.wasm.reaper
    if reaper is None:
        raise RuntimeError("this host frees stores where instances end (no reaper): nothing to compare")
    if policy == "queue":
        reaper.max_delay_s, reaper.free_when_behind = 1.0, False
    elif policy == "inline":
        reaper.max_pending = 0  # always behind: every store is freed by its instance's thread


def sustain(host: Host, program: str, args: list[str], n: int, want: str, warmup_s: float,
            measure_s: float) -> dict[str, Any]:
    ends: queue.Queue[tuple[float, InstanceEvent]] = queue.Queue()
    done: list[float] = []
    bad: list[str] = []
    stop = threading.Event()

    def on_event(ev: InstanceEvent) -> None:
        if ev.terminal:
            ends.put((time.perf_counter(), ev))

    def launcher() -> None:
        live = 0
        for _ in range(n):
            host.launch(program, args, on_event)
            live += 1
        while live:
            t, ev = ends.get()
            live -= 1
            if ev.event == "completed" and ev.message == want:
                done.append(t)
            else:
                bad.append(f"{ev.event}: {ev.message[:200]}")
            if not stop.is_set():
                host.launch(program, args, on_event)
                live += 1

    reaper = host.wasm.reaper  # set_policy has checked there is one
    max_pending = 0
    thread = threading.Thread(target=launcher, name="bench-launcher")
    t0 = time.perf_counter()
    thread.start()
    while time.perf_counter() - t0 < warmup_s:
        time.sleep(1.0)
        max_pending = max(max_pending, reaper.pending())
    f0 = host.scheduler.stats.as_dict()["forwards"]
    ru0, c0, w0 = resource.getrusage(resource.RUSAGE_SELF), len(done), time.perf_counter()
    while time.perf_counter() - w0 < measure_s:
        time.sleep(min(1.0, max(measure_s - (time.perf_counter() - w0), 0.0)))
        max_pending = max(max_pending, reaper.pending())
    ru1, c1, w1 = resource.getrusage(resource.RUSAGE_SELF), len(done), time.perf_counter()
    tokens = host.scheduler.stats.as_dict()["forwards"] - f0
    stop.set()
    thread.join(600)
    completed = c1 - c0
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"tokens": tokens, "completed": completed, "window_s": round(w1 - w0, 2),
            "cpu_ms_per_completion": round(1000 * cpu / max(completed, 1), 2),
            "minflt_per_completion": round((ru1.ru_minflt - ru0.ru_minflt) / max(completed, 1), 1),
            "refused": len(bad), "first_refusal": bad[0] if bad else None, "max_pending": max_pending}


def main() -> None:
    opts = parse_args()
    step_s = opts.step_ms / 1000
    results: dict[str, Any] = {}
    for n in opts.instances:
        results[str(n)] = {}
        for policy in opts.policies:
            host = make_host("inproc", step_s)
            try:
                set_policy(host, policy)
                program = compile_inferlet(host, "text_completion")
                want = expected_text(host, opts.tokens)
                settle(host, program, n)
                r = sustain(host, program, workload_args("app", opts.tokens), n, want, opts.warmup_s, opts.measure_s)
            finally:
                host.shutdown()
            tok_s = r["tokens"] / r["window_s"]
            ideal = n * opts.tokens / ((opts.tokens + 1) * step_s)
            results[str(n)][policy] = {"tok_s": round(tok_s, 1), "ideal_tok_s": round(ideal, 1),
                                       "efficiency": round(tok_s / ideal, 3), **r}
            print(n, policy, json.dumps(results[str(n)][policy]), flush=True)
    res = {"step_ms": opts.step_ms, "tokens": opts.tokens, "warmup_s": opts.warmup_s,
           "measure_s": opts.measure_s, "results": results}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    lines = [f"# bench/host_sustained.py ({opts.step_ms:g} ms step, {opts.tokens} tokens, window "
             f"{opts.measure_s:g} s after {opts.warmup_s:g} s)", "",
             "| instances | policy | tok/s | efficiency | CPU ms / completion | faults / completion | refused |",
             "|---|---|---|---|---|---|---|"]
    for n, by_policy in results.items():
        for policy, v in by_policy.items():
            lines.append(f"| {n} | {policy} | {v['tok_s']:.0f} | {v['efficiency']} | {v['cpu_ms_per_completion']} | "
                         f"{v['minflt_per_completion']} | {v['refused']} |")
    md = "\n".join(lines) + "\n"
    opts.json.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
