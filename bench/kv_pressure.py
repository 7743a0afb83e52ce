"""Under KV pressure nothing fails: N instances whose KV needs 4x / 8x the pool (host/suspend.py).

Usage: python bench/kv_pressure.py --json OUT [--step-ms 10] [--instances 16 64 256] [--factors 4 8]
                                   [--tokens 96] [--real N] [--real-tokens 48] [--no-real]

Stand-in part: the standard `text_completion` inferlet (host-side loop, greedy, `--tokens` new
tokens) on the stand-in backend sleeping `--step-ms` per batch, N instances launched at once on a
pool of N * pages_per_instance / factor pages. Each output is checked (the stand-in counts up from
the prompt's last token), so `completed` (must be 1.0) counts only exact outputs. The ideal for a
pool of that size: it holds `fit` = pool // pages_per_instance instances at once, so at best
ceil(N / fit) waves of (tokens + 1) steps each: ideal_tok_s = N * tokens / (waves * (tokens + 1) * step),
efficiency = tok_s / ideal_tok_s (tok_s: N * tokens over the wall time from the first launch to the
last end). `unpressured_*`: the same N on a pool that holds them all, in the same run (its ideal is
one wave). suspensions / swapped_mb per instance from `Host.stats()["memory"]`.

Real part (`--real N`, default 8): the default model on CPU, N chats of `--real-tokens` tokens on a
pool that holds a quarter of them at once, against the same chats on a pool that holds them all:
the outputs must be equal, token for token (greedy), and every instance completes.
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from common import Run, compile_inferlet

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig

PROMPT = "Write a story about a lighthouse."
PS = 16


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--step-ms", type=float, default=10.0, help="stand-in backend time per batch")
    ap.add_argument("--instances", type=int, nargs="+", default=[16, 64, 256], help="instances launched at once")
    ap.add_argument("--factors", type=int, nargs="+", default=[4, 8], help="KV needed / pool")
    ap.add_argument("--tokens", type=int, default=96, help="tokens generated per stand-in instance")
    ap.add_argument("--real", type=int, default=8, help="chats run on the real model (0: skip)")
    ap.add_argument("--real-tokens", type=int, default=48, help="tokens per real-model chat")
    return ap.parse_args()


def _pages_needed(host: Host, tokens: int) -> tuple[list[int], int]:
    tok = host.backend.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], True))
    return prompt, math.ceil((len(prompt) + tokens) / PS)


def burst(host: Host, program: str, args: list[str], n: int, want: str | None) -> dict[str, Any]:
    """Launch n at once; wall time and how many completed (with `want`, exactly that output)."""
    mem0 = host.memory_stats()
    t0 = time.perf_counter()
    runs = [Run(host, program, args) for _ in range(n)]
    ends = [r.finish(1800) for r in runs]
    wall = time.perf_counter() - t0
    ok = [e.message for e in ends if e.event == "completed" and (want is None or e.message == want)]
    mem = host.memory_stats()
    delta = {k: mem[k] - mem0.get(k, 0) for k in ("suspensions", "resumes", "swapped_pages", "swapped_bytes")}
    return {"wall_s": wall, "completed": len(ok) / n, "outputs": [e.message for e in ends],
            "ends": sorted({e.event for e in ends}), **delta}


def standin_entry(n: int, factor: int, step_s: float, tokens: int) -> dict[str, Any]:
    probe = Host(HostConfig(warm_auto=0), backend=StandInBackend(page_size=PS, num_pages=64))
    prompt, per = _pages_needed(probe, tokens)
    vocab = probe.backend.info.vocab_size
    want = probe.backend.tokenizer.decode([(prompt[-1] + 1 + i) % vocab for i in range(tokens)])
    probe.shutdown()
    pool = max(n * per // factor, per)
    args = ["--prompt", PROMPT, "--max-tokens", str(tokens)]
    out: dict[str, Any] = {"instances": n, "factor": factor, "pool_pages": pool, "pages_per_instance": per}
    for label, pages in (("", pool), ("unpressured_", n * per)):
        host = Host(HostConfig(), backend=StandInBackend(page_size=PS, num_pages=pages, delay_s=step_s))
        try:
            program = compile_inferlet(host, "text_completion")
            burst(host, program, args, min(n, 8), want)  # unmeasured: slots mapped, programs warm
            r = burst(host, program, args, n, want)
        finally:
            host.shutdown()
        fit = max(pages // per, 1)
        waves = math.ceil(n / fit)
        ideal = n * tokens / (waves * (tokens + 1) * step_s)
        tok_s = n * tokens * r["completed"] / r["wall_s"]
        out.update({f"{label}completed": r["completed"], f"{label}tok_s": round(tok_s, 1),
                    f"{label}ideal_tok_s": round(ideal, 1), f"{label}efficiency": round(tok_s / ideal, 3),
                    f"{label}wall_s": round(r["wall_s"], 2)})
        if not label:
            out.update({"suspensions_per_instance": round(r["suspensions"] / n, 2),
                        "swapped_mb_per_instance": round(r["swapped_bytes"] / n / 2**20, 4),
                        "resumes": r["resumes"]})
    print(json.dumps(out), flush=True)
    return out


def _chats(host: Host, prompts: list[str], tokens: int) -> tuple[list[str], dict[str, Any]]:
    program = compile_inferlet(host, "text_completion")
    t0 = time.perf_counter()
    runs = [Run(host, program, ["--prompt", p, "--max-tokens", str(tokens)]) for p in prompts]
    ends = [r.finish(1800) for r in runs]
    wall = time.perf_counter() - t0
    mem = host.memory_stats()
    return [e.message for e in ends], {
        "completed": sum(e.event == "completed" for e in ends) / len(prompts), "wall_s": round(wall, 2),
        "suspensions": mem.get("suspensions", 0), "swapped_mb": round(mem.get("swapped_bytes", 0) / 2**20, 2)}


def real_entry(n: int, tokens: int) -> dict[str, Any]:
    """The default model on CPU: n chats on a pool holding a quarter of them, against a pool holding all."""
    prompts = [f"Tell me a short fact about the number {i}." for i in range(n)]
    host = Host(HostConfig(device="cpu", num_pages=1024, warm_auto=0), progress=False)
    try:
        tok, ps = host.backend.tokenizer, host.backend.info.page_size
        per = max(math.ceil((len(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], True)))
                             + tokens) / ps) for p in prompts)
        want, full = _chats(host, prompts, tokens)
    finally:
        host.shutdown()
    pool = max(n * per // 4, per)
    host = Host(HostConfig(device="cpu", num_pages=pool, warm_auto=0), progress=False)
    try:
        got, quarter = _chats(host, prompts, tokens)
    finally:
        host.shutdown()
    results = {"instances": n, "tokens": tokens, "pool_pages": pool, "pages_per_instance": per, "full": full,
               "quarter": quarter, "outputs_equal": got == want}
    print(json.dumps(results), flush=True)
    return results


def main() -> None:
    a = parse_args()
    entries = [standin_entry(n, f, a.step_ms / 1000, a.tokens) for n in a.instances for f in a.factors]
    real = real_entry(a.real, a.real_tokens) if a.real else None
    result = {"step_ms": a.step_ms, "tokens": a.tokens, "standin": entries, "real_cpu": real}
    a.json.write_text(json.dumps(result, indent=1) + "\n")
    lines = ["| N | needs / pool | pool pages | completed | tok/s | ideal | eff | unpressured eff | "
             "suspensions / inst | swapped MB / inst |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        lines.append(f"| {e['instances']} | {e['factor']}x | {e['pool_pages']} | {e['completed']:.0%} | {e['tok_s']} | "
                      f"{e['ideal_tok_s']} | {e['efficiency']} | {e['unpressured_efficiency']} | "
                      f"{e['suspensions_per_instance']} | {e['swapped_mb_per_instance']} |")
    if real:
        lines.append("")
        lines.append(f"Real model (CPU), {real['instances']} chats x {real['tokens']} tokens, pool of "
                     f"{real['pool_pages']} pages (a quarter): completed {real['quarter']['completed']:.0%} in "
                     f"{real['quarter']['wall_s']} s ({real['quarter']['suspensions']} suspensions, "
                     f"{real['quarter']['swapped_mb']} MB swapped) vs {real['full']['wall_s']} s on a pool "
                     f"holding all; outputs equal: {real['outputs_equal']}")
    a.json.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
