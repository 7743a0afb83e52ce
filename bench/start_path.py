"""A launched instance's start path with this checkout's SDK against the SDK of another revision.

Usage: python bench/start_path.py --json OUT --baseline REV [--instances 256] [--bursts 5] [--rounds 3]
                                  [--step-ms 10] [--quick]

`text_completion` is built twice: with the SDK (and the inferlet) of git revision REV, and with this
checkout's. Both run on this checkout's host, in front of the stand-in sleeping `--step-ms` per
batch, alternating builds for `--rounds` rounds: each round a fresh host (`Host.warm_start`, as
`pie-serve` starts) takes a first burst of N, then `--bursts` bursts back to back (as
bench/host_scale.py --back-to-back). Per build and round: `fresh` and `back_to_back` (the median)
efficiency, and `start_cpu_ms`, the median thread CPU a launched warm instance spends from its
launch to its first wait (its first forward: the guest's start path and its host calls), and
`calls_before_first_wait`, the host calls it makes in that span (median).
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import ROOT
from host_scale import expected_text, make_host, run_once, workload_args
from load_model import export_rev

import host.api as api
from host.wasm import instance as instance_module

_local = threading.local()
_starts: list[tuple[float, int]] = []  # (thread CPU s, host calls) from launch to the first wait


def _instrument() -> None:
    """Time each launched warm instance from its launch (it leaves `await_launch`) to its first wait,
    and count its host calls meanwhile (every import goes through `host.api.add_func`'s callback)."""
    await_launch, end_start = instance_module.Instance.await_launch, instance_module.Instance._end_start
    add_func = api.add_func

    def timed_await(self: Any) -> None:
        await_launch(self)
        _local.t0, _local.calls = time.thread_time(), 0

    def timed_end(self: Any) -> None:
        if self._starting and getattr(_local, "t0", None) is not None:
            _starts.append((time.thread_time() - _local.t0, _local.calls))
            _local.t0 = None
        end_start(self)

    def counting_add_func(li: Any, name: str, fn: Any, **kw: Any) -> None:
        def counted(store: Any, *args: Any) -> Any:
            _local.calls = getattr(_local, "calls", 0) + 1
            return fn(store, *args)
        add_func(li, name, counted, **kw)

    instance_module.Instance.await_launch = timed_await  # type: ignore[method-assign]
    instance_module.Instance._end_start = timed_end  # type: ignore[method-assign]
    api.add_func = counting_add_func  # type: ignore[assignment]


def build(tree: Path | None) -> bytes:
    """text_completion built with the SDK of `tree` (a revision's files), or of this checkout."""
    env = dict(os.environ)
    if tree is not None:  # its host for the build key, its SDK and inferlets for the sources
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{tree / 'inferlets'}"
    code = "from host.cli.build import resolve_inferlet; print(resolve_inferlet('text_completion', quiet=True))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree or ROOT, capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    return Path(out).read_bytes()


def measure(wasm: bytes, n: int, bursts: int, step_s: float, warm_auto: int | None = None) -> dict[str, Any]:
    """`warm_auto`: the host's (HostConfig) instead of its default (256, the default burst's size)."""
    host = make_host("inproc", step_s, **({} if warm_auto is None else {"warm_auto": warm_auto}))
    try:
        [program] = host.warm_start([wasm])
        want, args = expected_text(host, 64), workload_args("app", 64)
        fresh = run_once(host, program, args, n, want, step_s, 64)["efficiency"]
        effs, cpus, calls = [], [], []
        for _ in range(bursts):
            _starts.clear()
            effs.append(run_once(host, program, args, n, want, step_s, 64)["efficiency"])
            if _starts:
                cpus.append(statistics.median(c for c, _ in _starts) * 1000)
                calls.append(statistics.median(k for _, k in _starts))
    finally:
        host.shutdown()
    return {"fresh": fresh, "back_to_back": round(statistics.median(effs), 3), "back_to_back_all": effs,
            "start_cpu_ms": round(statistics.median(cpus), 3) if cpus else None,
            "calls_before_first_wait": statistics.median(calls) if calls else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--baseline", help="the git revision whose SDK is measured against this one (required; "
                                       "--quick: HEAD by default)")
    ap.add_argument("--instances", type=int, default=256)
    ap.add_argument("--bursts", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 8 instances (and 8 kept warm), 1 burst, 1 round, HEAD as the "
                         "baseline unless given")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(baseline="HEAD", instances=8, bursts=1, rounds=1)
        opts = ap.parse_args()
    if opts.baseline is None:
        ap.error("the following arguments are required: --baseline")
    _instrument()
    with tempfile.TemporaryDirectory(prefix="pie-bench-sdk-") as tmp:
        builds = {f"baseline {opts.baseline}": build(export_rev(opts.baseline, Path(tmp) / "base")),
                  "this checkout": build(None)}
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    for _ in range(opts.rounds):
        for name, wasm in builds.items():
            row = measure(wasm, opts.instances, opts.bursts, opts.step_ms / 1000,
                          opts.instances if opts.quick else None)
            rounds[name].append(row)
            print(f"{name}: {json.dumps(row)}", flush=True)
    out = {"instances": opts.instances, "step_ms": opts.step_ms, "rounds": rounds}
    opts.json.write_text(json.dumps(out, indent=1) + "\n")
    lines = [f"# bench/start_path.py ({opts.instances} text_completion a burst, {opts.step_ms:g} ms step, "
             f"builds alternated, {opts.rounds} rounds)", "",
             "| build | fresh | back to back | start CPU ms | calls before the first wait |", "|---|---|---|---|---|"]
    for name, rows in rounds.items():
        for r in rows:
            lines.append(f"| {name} | {r['fresh']} | {r['back_to_back']} | {r['start_cpu_ms']} | "
                         f"{r['calls_before_first_wait']} |")
    opts.json.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
