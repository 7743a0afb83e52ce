"""bench/revisions.py's inner run, in a process of its own with one revision's tree first on PYTHONPATH.

It uses only what every revision since 3f426ae has (`Host`, `HostConfig`, `StandInBackend`,
`resolve_inferlet`), not bench/common.py, which belongs to the checkout running the comparison.
The inferlet is built from the tree's own SDK and WIT (`host.cli.sources` is pointed at the tree:
the installed package maps them to the checkout it was installed from). Prints one JSON list, a
dict per burst (bench/revisions.py says what each key is).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import time
from pathlib import Path
from typing import Any

import host.cli.sources as sources
from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.cli.build import resolve_inferlet

PROMPT = "Write a story about a lighthouse."


class ForwardOnly:
    """The stand-in behind a backend with only `forward` (and `copy_tokens`), its calls timed."""

    def __init__(self, inner: StandInBackend) -> None:
        self._inner = inner
        self.info, self.tokenizer = inner.info, inner.tokenizer
        self.calls: list[tuple[float, float, int]] = []  # (start, end, batch size)

    def forward(self, reqs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._inner.forward(reqs)
        finally:
            self.calls.append((t0, time.perf_counter(), len(reqs)))

    def copy_tokens(self, *args: Any) -> Any:
        return self._inner.copy_tokens(*args)


def burst(host: Host, program: str, args: list[str], n: int, tokens: int, step_s: float,
          backend: ForwardOnly) -> dict[str, Any]:
    first_call = len(backend.calls)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    events: list[queue.Queue[Any]] = []
    for _ in range(n):
        q: queue.Queue[Any] = queue.Queue()
        host.launch(program, args, q.put)
        events.append(q)
    last_end = 0.0
    for q in events:
        while True:
            ev = q.get(timeout=600)
            if ev.terminal:
                last_end = max(last_end, time.perf_counter())
                if ev.event != "completed":
                    raise RuntimeError(f"an instance ended {ev.event}: {ev.message[:300]}")
                break
    wall = time.perf_counter() - t0
    calls = sorted(backend.calls[first_call:])
    full = [c for c in calls if c[2] >= 0.9 * n]
    periods = [b[0] - a[0] for a, b in zip(calls, calls[1:], strict=False) if a[2] == n and b[2] == n]
    ideal_tok_s = n * tokens / ((tokens + 1) * step_s)  # one prefill step and `tokens` decode steps for all n
    return {"n": n, "efficiency": round(n * tokens / wall / ideal_tok_s, 3),
            "ramp_ms": round(1000 * (full[0][0] - t0), 1) if full else -1,
            "period_ms": round(1000 * statistics.median(periods), 2) if periods else -1,
            "tail_ms": round(1000 * (last_end - calls[-1][1]), 1) if calls else -1,
            "cpu_ms": round(1000 * (time.process_time() - cpu0) / n, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    ap.add_argument("--step-ms", type=float, required=True)
    ap.add_argument("--tokens", type=int, required=True)
    ap.add_argument("--config", default="{}")
    opts = ap.parse_args()
    tree = Path(os.environ["PYTHONPATH"]).resolve()
    dirs = {"host.wit": tree / "wit", "inferlet": tree / "inferlets" / "inferlet", "host.inferlets": tree / "inferlets"}
    sources._package_dir = lambda package: dirs[package]  # type: ignore[assignment]
    step_s = opts.step_ms / 1000
    backend = ForwardOnly(StandInBackend(page_size=16, num_pages=16384, delay_s=step_s))
    host = Host(HostConfig(**json.loads(opts.config)), backend=backend)  # type: ignore[arg-type]
    try:
        program = host.compile(resolve_inferlet("text_completion", quiet=True).read_bytes())
        args = ["--prompt", PROMPT, "--max-tokens", str(opts.tokens), "--raw"]
        out = []
        for n in opts.sizes:
            pool = getattr(host, "warm", None)
            ready = pool.ready_count(program) if pool is not None and hasattr(pool, "ready_count") else -1
            out.append({**burst(host, program, args, n, opts.tokens, step_s, backend), "warm": ready})
    finally:
        host.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
