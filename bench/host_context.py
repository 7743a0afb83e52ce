"""What a guest-driven token costs the host as the context grows (the page list it sends every step).

Usage: python bench/host_context.py --json OUT [--instances 16] [--tokens 64 1024 4096] [--bursts 3] [--quick]

N instances of bench/inferlets/stepper (every token a `forward.decode-step`, whose arguments
include the instance's whole page list) generate `--tokens` tokens each against the stand-in
backend with no delay, so the wall time is the host's own work (and the stand-in's validation):
`us_per_token` is wall / (N * tokens), the median of `--bursts` bursts on one host (after an
unmeasured one of the same length). The baseline
is the first length in the same run: `ratio` = us_per_token / us_per_token at that length. A
context of `t` tokens is t / 16 pages; everything the host does per page per step (the list's
conversion, the page checks, pins, the scheduler's footprint sets) shows up as a ratio above 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from common import ROOT, Run, compile_inferlet, settle

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig

PROMPT = "Write a story about a lighthouse."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--instances", type=int, default=16, help="concurrent instances")
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 1024, 4096], help="tokens per instance")
    ap.add_argument("--bursts", type=int, default=3, help="bursts per length (the median is reported)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 4 instances, 16 and 64 tokens, 1 burst")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=4, tokens=[16, 64], bursts=1)
        opts = ap.parse_args()
    n = opts.instances
    host = Host(HostConfig(), backend=StandInBackend(page_size=16, num_pages=65536, delay_s=0.0))
    per_token: dict[str, float] = {}
    try:
        program = compile_inferlet(host, ROOT / "bench" / "inferlets" / "stepper")
        last = host.backend.tokenizer.encode(PROMPT)[-1]
        vocab = host.backend.info.vocab_size
        for tokens in opts.tokens:
            want = " ".join(str((last + 1 + i) % vocab) for i in range(tokens))
            runs_us = []
            for burst in range(opts.bursts + 1):  # the first, unmeasured: pool slots and the warm pool
                settle(host, program, n)
                t0 = time.perf_counter()
                runs = [Run(host, program, [str(tokens), PROMPT]) for _ in range(n)]
                for r in runs:
                    end = r.finish(600)
                    if end.event != "completed" or end.message != want:
                        raise RuntimeError(f"wrong result: {end.event}: {end.message[:120]!r}")
                if burst:
                    runs_us.append(1e6 * (time.perf_counter() - t0) / (n * tokens))
            per_token[str(tokens)] = round(statistics.median(runs_us), 1)
            print(f"{tokens} tokens: {per_token[str(tokens)]} us per token and instance", flush=True)
    finally:
        host.shutdown()
    base = per_token[str(opts.tokens[0])]
    res = {"instances": n, "page_size": 16, "us_per_token": per_token,
           "ratio": {k: round(v / base, 3) for k, v in per_token.items()}}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
