"""Step lookahead on vs off: guests that step every token themselves, in front of a stand-in GPU step.

Usage: python bench/host_lookahead.py --json OUT [--step-ms 10] [--instances 16 64] [--bursts 5] [--quick]

Two hosts in one process, the same as bench/host_scale.py's `step` workload (the stepper guest,
bench/inferlets/stepper: 64 greedy `decode-step` calls), one with `HostConfig.step_lookahead` on
(the default: the host runs a stepping guest's predicted next step in the batch after the one
that drew its token, host/api/lookahead.py's `Stepper`) and one with it off: the baseline. Bursts
of N launches alternate between the two (the order flips every burst), each after the warm pool
has refilled, so both see the same hour of this noisy VM. Every output is checked. Reported per N:
the median efficiency (tok/s over the ideal N * tokens / ((tokens + 1) * step)) of each, their
ratio, and for the lookahead host the steps run ahead and withdrawn per burst.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import ROOT, compile_inferlet, settle
from host_scale import expected_steps, make_host, run_once, workload_args

from host import Host


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--step-ms", type=float, default=10.0, help="backend time per batch")
    ap.add_argument("--instances", type=int, nargs="+", default=[16, 64], help="concurrent instances")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per instance")
    ap.add_argument("--bursts", type=int, default=5, help="measured bursts per host and N")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 4 instances, 16 tokens, 2 bursts")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=[4], tokens=16, bursts=2)
        opts = ap.parse_args()
    return opts


def main() -> None:
    opts = parse_args()
    step_s = opts.step_ms / 1000
    hosts: dict[str, tuple[Host, str]] = {}
    for name, on in (("on", True), ("off", False)):
        h = make_host("inproc", step_s, step_lookahead=on)
        hosts[name] = (h, compile_inferlet(h, ROOT / "bench" / "inferlets" / "stepper"))
    try:
        want = expected_steps(hosts["on"][0], opts.tokens)
        args = workload_args("step", opts.tokens)
        results: dict[str, Any] = {}
        for n in opts.instances:
            effs: dict[str, list[float]] = {"on": [], "off": []}
            ahead: list[int] = []
            withdrawn: list[int] = []
            for h, prog in hosts.values():  # unmeasured: slots mapped, the warm pool learns n
                run_once(h, prog, args, n, want, step_s, opts.tokens)
            for b in range(opts.bursts):
                order = ["on", "off"] if b % 2 == 0 else ["off", "on"]
                for name in order:
                    h, prog = hosts[name]
                    settle(h, prog, n)
                    before = h.scheduler.stats.as_dict()
                    r = run_once(h, prog, args, n, want, step_s, opts.tokens)
                    after = h.scheduler.stats.as_dict()
                    effs[name].append(r["efficiency"])
                    if name == "on":
                        ahead.append(after["lookaheads"] - before["lookaheads"])
                        withdrawn.append(after["lookaheads_withdrawn"] - before["lookaheads_withdrawn"])
            on, off = statistics.median(effs["on"]), statistics.median(effs["off"])
            results[str(n)] = {"efficiency_on": on, "efficiency_off": off, "ratio": round(on / off, 3),
                               "runs_on": effs["on"], "runs_off": effs["off"],
                               "steps_run_ahead_per_burst": statistics.median(ahead),
                               "withdrawn_per_burst": statistics.median(withdrawn),
                               "steps_per_burst": n * opts.tokens}
            print(n, json.dumps(results[str(n)]), flush=True)
    finally:
        for h, _ in hosts.values():
            h.shutdown()
    out = {"step_ms": opts.step_ms, "tokens": opts.tokens, "bursts": opts.bursts, "instances": results,
           "when": time.strftime("%Y-%m-%d %H:%M")}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
