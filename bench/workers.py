"""Completions per second with the guests in worker processes (`HostConfig.workers`) vs in the host's
process, closed loop: issue 49's measure of whether the host uses every core.

Usage: python bench/workers.py --json OUT [--workers 0 2] [--clients 64] [--tokens 16] [--step-ms 2]
                               [--seconds 10] [--rounds 3] [--idle-threads 256 0] [--quick]

`--clients` client threads each launch the standard `text_completion` (`--raw`, `--tokens` new
tokens) and wait for its end, again and again, against a host in front of the stand-in backend
(gpu_backend/standin.py: `--step-ms` per batch, deterministic tokens, every output checked). After
`--warmup` seconds, the completions that end within `--seconds` are counted: `completions_s`,
with the process tree's CPU in that window (`cpu_s`; `host_cpu_s`: the host's process, clients
included, `workers_cpu_s`: its workers'), the median time per completion (`latency_ms`), and per
completion the CPU and minor page faults of the host's process and of its workers
(`host_cpu_ms_per_completion`, `workers_cpu_ms_per_completion`, `host_faults_per_completion`,
`workers_faults_per_completion`), the context switches of their threads per completion
(`host_switches_per_completion`: all of the host's, `workers_switches_per_completion`: the workers'
live threads; thread hand-offs and GIL waits), and how the run's launches started (`launches_warm`, `launches_cold`). Each setting runs on a fresh host, the settings alternate over
`--rounds`; the entry is the round with the median rate and `ratio` is each setting's median rate
over the first setting's (in-process, 0). `--idle-threads N M`: every setting also with each of these
caps on the instance threads kept for reuse (host/wasm/threads.py; 0: a thread per instance, as
before; the entries are then named "W, idle N"). `--quick` (CI): 0 and 1 worker, 8 clients, 1 s windows,
one round.
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.cli.build import resolve_inferlet
from host.cli.options import _workers
from host.wasm import threads as instance_threads

PROMPT = "Write a story about a lighthouse."


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--workers", type=_workers, nargs="+", default=[0, 2],
                    help="settings of HostConfig.workers: counts, or auto (one per core, the default)")
    ap.add_argument("--clients", type=int, default=64, help="client threads, each one completion at a time")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per completion")
    ap.add_argument("--step-ms", type=float, default=2.0, help="the stand-in's time per batch")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    ap.add_argument("--seconds", type=float, default=10.0, help="the measured window")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every setting, alternated")
    ap.add_argument("--idle-threads", type=int, nargs="+", default=[instance_threads.MAX_IDLE],
                    help="caps on the instance threads kept for reuse, each a setting (0: none kept)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 0 and 1 worker, 8 clients, 1 s windows, one round")
    opts = ap.parse_args()
    if opts.quick:
        opts.workers, opts.clients, opts.warmup, opts.seconds, opts.rounds = [0, 1], 8, 1.0, 1.0, 1
    if opts.clients < 1 or opts.tokens < 1 or opts.rounds < 1 or opts.seconds <= 0 or min(opts.idle_threads) < 0:
        ap.error("--workers and --idle-threads must be >= 0; --clients, --tokens, --rounds at least 1; "
                 "--seconds above 0")
    return opts


def _switches(pid: str) -> int:
    """Context switches (voluntary and not) of process `pid`'s live threads, from /proc."""
    n = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        try:
            for line in status.read_text().splitlines():
                if "ctxt_switches:" in line:
                    n += int(line.split()[-1])
        except (OSError, ValueError):
            continue
    return n


def _usage() -> tuple[tuple[float, float], tuple[int, int], tuple[int, int]]:
    """(CPU seconds, minor page faults, context switches) of this process (the host and the
    clients) and, summed, of its running children (the workers), read from /proc in one pass."""
    t = os.times()
    ru = resource.getrusage(resource.RUSAGE_SELF)
    cpu, faults, switches = 0.0, 0, 0
    tick = os.sysconf("SC_CLK_TCK")
    me = str(os.getpid())
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # ppid: a worker of this host
            cpu += (int(fields[11]) + int(fields[12])) / tick
            faults += int(fields[7])
            switches += _switches(stat.parent.name)
    return (t.user + t.system, cpu), (ru.ru_minflt, faults), (ru.ru_nvcsw + ru.ru_nivcsw, switches)


def run(opts: argparse.Namespace, workers: int | str, wasm: bytes | None = None,
        idle_threads: int | None = None) -> dict[str, Any]:
    """One setting on a fresh host; `wasm`: the text_completion component (None: the standard build);
    `idle_threads`: the cap on instance threads kept, here and in the host's workers (None: as set)."""
    if idle_threads is not None:  # (this process's pool, and the workers' through their environment)
        instance_threads._threads.max_idle = idle_threads
        os.environ["PIE_IDLE_THREADS"] = str(idle_threads)
    host = Host(HostConfig(workers=workers),
                backend=StandInBackend(page_size=16, num_pages=16384, delay_s=opts.step_ms / 1000))
    try:
        program = host.compile(wasm if wasm is not None else resolve_inferlet("text_completion", quiet=True).read_bytes())
        tok = host.backend.tokenizer
        last = tok.encode(PROMPT)[-1]
        want = tok.decode([(last + 1 + i) % host.backend.info.vocab_size for i in range(opts.tokens)])
        args = ["--prompt", PROMPT, "--max-tokens", str(opts.tokens), "--raw"]
        ends: list[tuple[float, float]] = []  # (end time, latency) of every completion
        errors: list[str] = []
        stop = threading.Event()
        lock = threading.Lock()

        def client() -> None:
            while not stop.is_set():
                done = threading.Event()
                out: list[Any] = []

                def on_event(ev: Any, done: threading.Event = done, out: list[Any] = out) -> None:
                    if ev.terminal:
                        out.append(ev)
                        done.set()

                t0 = time.perf_counter()
                host.launch(program, args, on_event)
                done.wait(120)
                ev = out[0] if out else None
                if ev is None or ev.event != "completed" or ev.message != want:
                    errors.append(f"{ev and ev.event}: {ev and ev.message[:200]!r}")
                    stop.set()
                    return
                now = time.perf_counter()
                with lock:
                    ends.append((now, now - t0))

        threads = [threading.Thread(target=client, daemon=True) for _ in range(opts.clients)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(opts.warmup)
        (cpu0, f0, s0), w0 = _usage(), time.perf_counter()
        time.sleep(opts.seconds)
        (cpu1, f1, s1), w1 = _usage(), time.perf_counter()
        stop.set()
        for t in threads:
            t.join(120)
        if errors:
            raise RuntimeError(f"workers={workers}: a completion went wrong: {errors[0]}")
        window = [lat for end, lat in ends if w0 <= end < w1]
        started = host.stats()["warm_pool"]  # (whole run, warm-up included: how the launches started)

        def per(total: float, scale: float = 1.0) -> float | None:
            return round(scale * total / len(window), 2) if window else None

        return {"workers": workers, "worker_processes": host.config.worker_count,
                "completions_s": round(len(window) / (w1 - w0), 1),
                "cpu_s": round(sum(cpu1) - sum(cpu0), 2), "host_cpu_s": round(cpu1[0] - cpu0[0], 2),
                "workers_cpu_s": round(cpu1[1] - cpu0[1], 2), "latency_ms": round(1000 * statistics.median(window), 1) if window else None,
                "completions": len(window), "since_start_s": round(w0 - start, 2),
                # where a completion's CPU goes (the window's CPU over its completions)
                "host_cpu_ms_per_completion": per(cpu1[0] - cpu0[0], 1000),
                "workers_cpu_ms_per_completion": per(cpu1[1] - cpu0[1], 1000),
                "host_faults_per_completion": per(f1[0] - f0[0]),
                "workers_faults_per_completion": per(f1[1] - f0[1]),
                "host_switches_per_completion": per(s1[0] - s0[0]),
                "workers_switches_per_completion": per(s1[1] - s0[1]),
                "launches_warm": started["launches_warm"], "launches_cold": started["launches_cold"]}
    finally:
        host.shutdown()


def measure(opts: argparse.Namespace, wasm: bytes | None = None) -> dict[str, Any]:
    """Every setting of `opts.workers`, alternated over `opts.rounds`: the JSON `main` writes (the
    GPU kit's `workers` section calls this with the kit's component)."""
    idle = getattr(opts, "idle_threads", None) or [None]
    settings = {(str(w) if len(idle) == 1 else f"{w}, idle {n}"): (w, n) for n in idle for w in opts.workers}
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in settings}
    for _ in range(opts.rounds):
        for k, (w, n) in settings.items():
            rounds[k].append({**run(opts, w, wasm, n), "idle_threads": n})
            print(json.dumps(rounds[k][-1]), flush=True)
    base = statistics.median(r["completions_s"] for r in rounds[next(iter(settings))])
    res: dict[str, Any] = {"clients": opts.clients, "tokens": opts.tokens, "step_ms": opts.step_ms,
                           "seconds": opts.seconds, "cores": os.cpu_count(), "settings": {}}
    for w, rs in rounds.items():
        entry = sorted(rs, key=lambda r: r["completions_s"])[len(rs) // 2]
        rate = statistics.median(r["completions_s"] for r in rs)
        res["settings"][w] = {**entry, "rounds": [r["completions_s"] for r in rs],
                                   "ratio": round(rate / base, 3) if base else None}
    return res


def main() -> None:
    opts = parse_args()
    res = measure(opts)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    lines = [f"# bench/workers.py: {opts.clients} clients, `text_completion --raw` {opts.tokens} tokens, "
             f"{opts.step_ms:g} ms stand-in step, {os.cpu_count()} cores", "",
             "| workers | completions/s (rounds) | ratio | CPU s in the window | median latency ms "
             "| CPU ms per completion, host / workers | page faults per completion, host / workers "
             "| context switches per completion, host / workers |",
             "|---|---|---|---|---|---|---|---|"]
    for w, e in res["settings"].items():
        lines.append(f"| {w} | {e['completions_s']} ({e['rounds']}) | {e['ratio']} | {e['cpu_s']} | {e['latency_ms']} "
                     f"| {e['host_cpu_ms_per_completion']} / {e['workers_cpu_ms_per_completion']} "
                     f"| {e['host_faults_per_completion']} / {e['workers_faults_per_completion']} "
                     f"| {e['host_switches_per_completion']} / {e['workers_switches_per_completion']} |")
    md = "\n".join(lines) + "\n"
    opts.json.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
