"""Where the host's per-step time goes between batches (diagnosis for the 16-instance tax).

Usage: python bench/host_step_gap.py --json OUT [--step-ms 80] [--quick]

Runs N instances against a fake backend that sleeps `step-ms` per batch (no model), with two
guests: `raw` (bench/inferlets/hostcalls: one forward.run per step, nothing else) and `sdk`
(tests/fixtures/misbehave `generate`: the SDK's decode loop). Reports the gap per batch beyond the
backend's own time, at 1 and 16 instances, and for one instance the latency from a forward's
completion to the instance's wake-up and from the wake-up to its next submit; round_trip_us: one
1-token pass timed in the guest with a zero-cost backend, `forward.run` vs `forward.decode-step`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import ROOT, Run, compile_inferlet

import host.wasm.instance as instance_mod
from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.batching.future import ForwardFuture

STEPS = 30


def gap_ms(host: Host, fb: StandInBackend, program: str, args: list[str], n: int, step_s: float) -> float:
    fb.batches.clear()
    t0 = time.perf_counter()
    runs = [Run(host, program, args) for _ in range(n)]
    for r in runs:
        if r.finish(300).event != "completed":
            raise RuntimeError(r.end)
    return 1000 * ((time.perf_counter() - t0) / len(fb.batches) - step_s)


def wake_latency_us(host: Host, program: str) -> tuple[float, float]:
    marks: dict[str, list[float]] = {"fin": [], "woke": [], "sub": []}
    finish, wait_until, submit = (ForwardFuture.finish, instance_mod.Instance.wait_until,
                                  host.scheduler.submit)

    def fin(self, r, e):  # type: ignore[no-untyped-def]
        marks["fin"].append(time.perf_counter())
        finish(self, r, e)

    def woke(self, ready, timeout_s=None):  # type: ignore[no-untyped-def]
        r = wait_until(self, ready, timeout_s)
        marks["woke"].append(time.perf_counter())
        return r

    def sub(req, owner):  # type: ignore[no-untyped-def]
        marks["sub"].append(time.perf_counter())
        return submit(req, owner)

    ForwardFuture.finish = fin  # type: ignore[method-assign]
    instance_mod.Instance.wait_until = woke  # type: ignore[method-assign]
    host.scheduler.submit = sub  # type: ignore[method-assign]
    try:
        Run(host, program, ["forward", str(STEPS)]).finish(120)
    finally:
        ForwardFuture.finish = finish  # type: ignore[method-assign]
        instance_mod.Instance.wait_until = wait_until  # type: ignore[method-assign]
        host.scheduler.submit = submit  # type: ignore[method-assign]
    f, w, s = marks["fin"], marks["woke"], marks["sub"]
    idx = range(5, min(len(f), len(w), len(s) - 1))
    return (1e6 * statistics.median(w[i] - f[i] for i in idx), 1e6 * statistics.median(s[i + 1] - w[i] for i in idx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--step-ms", type=float, default=80.0, help="fake backend time per batch")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): a 5 ms step, 1 and 4 instances, 100-pass round trips")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(step_ms=5.0)
        opts = ap.parse_args()
    sizes = (1, 4) if opts.quick else (1, 16)
    step_s = opts.step_ms / 1000
    fb = StandInBackend(page_size=16, num_pages=4096, delay_s=step_s)
    host = Host(HostConfig(), backend=fb)
    raw = compile_inferlet(host, ROOT / "bench" / "inferlets" / "hostcalls")
    sdk = compile_inferlet(host, ROOT / "tests" / "fixtures" / "misbehave")
    res: dict = {"step_ms": opts.step_ms, "gap_ms": {}}
    for name, prog, args in [("raw", raw, ["forward", str(STEPS)]), ("sdk", sdk, ["generate", str(STEPS), "5", "6"])]:
        res["gap_ms"][name] = {str(n): gap_ms(host, fb, prog, args, n, step_s) for n in sizes}
    res["one_instance_us"] = dict(zip(("finish_to_wake", "wake_to_next_submit"), wake_latency_us(host, raw),
                                      strict=True))
    fb.delay_s = 0.0
    res["one_instance_us_no_wait"] = dict(zip(("finish_to_wake", "wake_to_next_submit"),
                                              wake_latency_us(host, raw), strict=True))
    # one pass from the guest with a zero-cost backend: forward.run with one spec vs forward.decode-step
    passes = "100" if opts.quick else "500"
    res["round_trip_us"] = {mode: statistics.median(float(Run(host, raw, [mode, passes]).finish(120).message)
                                                    for _ in range(3)) for mode in ("forward", "decode")}
    host.shutdown()
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
