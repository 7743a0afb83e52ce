"""Under KV pressure nothing fails: N instances whose KV needs 4x / 8x the pool (host/suspend.py).

Usage: python bench/kv_pressure.py --json OUT [--step-ms 10] [--instances 16 64 256] [--factors 4 8]
                                   [--tokens 96] [--real N] [--real-tokens 48] [--quick]

Stand-in part: the standard `text_completion` inferlet (host-side loop, greedy, `--tokens` new
tokens) on the stand-in backend sleeping `--step-ms` per batch, N instances launched at once on a
pool of N * pages_per_instance / factor pages; each prompt differs from its first page on (no
prefix-cache sharing). Each output is checked (the stand-in counts up from the prompt's last
token), so `completed` (must be 1.0) counts only exact outputs. The ideal for a pool of that size
(an upper bound): an instance holds prompt + tokens / 2 slots on average over its life, so the
pool's slots run at most `fit` = pool * page_size / that many at once, one token each per step:
ideal_tok_s = N * tokens / (max(1, N / fit) * (tokens + 1) * step), efficiency = tok_s / ideal_tok_s
(tok_s: N * tokens over the wall time from the first launch to the last end). `unpressured_*`: the
same N on a pool that holds them all, in the same run. suspensions / swapped_mb per instance from
`Host.stats()["memory"]`.

Real part (`--real N`, default 8): the default model on CPU, N chats of `--real-tokens` tokens on a
pool that holds a quarter of them at once, against the same chats on a pool that holds them all:
the outputs must be equal, token for token (greedy), and every instance completes.
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from common import Run, compile_inferlet

from gpu_backend.standin import StandInBackend
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
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
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 8 instances at 4x, 32 tokens; 4 real chats of 8 tokens, "
                         "swap vs prefill at 4 pages")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=[8], factors=[4], tokens=32, real=4, real_tokens=8)
        opts = ap.parse_args()
    return opts


def _prompt(i: int) -> str:
    return f"{i:04d} {PROMPT}"  # all of one length, each its own first page


def burst(host: Host, program: str, tokens: int, n: int, want: str | None) -> dict[str, Any]:
    """Launch n at once; wall time and how many completed (with `want`, exactly that output)."""
    mem0 = host.memory_stats()
    t0 = time.perf_counter()
    runs = [Run(host, program, ["--prompt", _prompt(i), "--max-tokens", str(tokens)]) for i in range(n)]
    ends = [r.finish(1800) for r in runs]
    wall = time.perf_counter() - t0
    ok = [e.message for e in ends if e.event == "completed" and (want is None or e.message == want)]
    mem = host.memory_stats()
    delta = {k: mem[k] - mem0.get(k, 0) for k in ("suspensions", "resumes", "swapped_pages", "swapped_bytes")}
    return {"wall_s": wall, "completed": len(ok) / n, "outputs": [e.message for e in ends],
            "ends": sorted({e.event for e in ends}), **delta}


def standin_entry(n: int, factor: int, step_s: float, tokens: int) -> dict[str, Any]:
    tok = StandInBackend().tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": _prompt(0)}], True))
    per = math.ceil((len(prompt) + tokens) / PS)
    want = tok.decode([(prompt[-1] + 1 + i) % StandInBackend().info.vocab_size for i in range(tokens)])
    pool = max(n * per // factor, per)
    out: dict[str, Any] = {"instances": n, "factor": factor, "pool_pages": pool, "pages_per_instance": per}
    for label, pages in (("", pool), ("unpressured_", n * per)):
        host = Host(HostConfig(), backend=StandInBackend(page_size=PS, num_pages=pages, delay_s=step_s))
        try:
            program = compile_inferlet(host, "text_completion")
            burst(host, program, tokens, min(n, 8), want)  # unmeasured: slots mapped, programs warm
            r = burst(host, program, tokens, n, want)
        finally:
            host.shutdown()
        fit = pages * PS / (len(prompt) + tokens / 2)
        ideal = n * tokens / (max(1.0, n / fit) * (tokens + 1) * step_s)
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


def swap_vs_prefill(backend: Any, pages: int, reps: int = 3) -> dict[str, float]:
    """Resuming a plain causal sequence of `pages` full pages: its K/V copied out and back in
    (`swap_out` + `swap_in`), or dropped and recomputed (one prefill forward over its tokens), ms."""
    ps = backend.info.page_size
    ids = list(range(pages))
    tokens = (backend.tokenizer.encode("The sea is calm tonight. " * (pages * ps)) * 2)[: pages * ps]
    req = ForwardRequest(pages=ids, last_page_len=ps, tokens=tokens, positions=list(range(len(tokens))),
                         outputs=[OutputSpec(index=len(tokens) - 1, sample=SamplerParams())])
    swap, prefill = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        backend.forward([req])
        t1 = time.perf_counter()
        backend.swap_in(backend.swap_out(ids), ids)
        t2 = time.perf_counter()
        prefill.append(1000 * (t1 - t0))
        swap.append(1000 * (t2 - t1))
    return {"pages": pages, "swap_ms": round(statistics.median(swap), 2),
            "prefill_ms": round(statistics.median(prefill), 2),
            "swap_mb": round(pages * backend.swap_page_bytes / 2**20, 2)}


def real_entry(n: int, tokens: int, resume_pages: tuple[int, ...] = (4, 16, 64)) -> dict[str, Any]:
    """The default model on CPU: n chats on a pool holding a quarter of them, against a pool holding all."""
    prompts = [f"Tell me a short fact about the number {i}." for i in range(n)]
    host = Host(HostConfig(device="cpu", num_pages=1024, warm_auto=0), progress=False)
    try:
        tok, ps = host.backend.tokenizer, host.backend.info.page_size
        per = max(math.ceil((len(tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], True)))
                             + tokens) / ps) for p in prompts)
        want, full = _chats(host, prompts, tokens)
        resume = [swap_vs_prefill(host.backend, k) for k in resume_pages]
    finally:
        host.shutdown()
    pool = max(n * per // 4, per)
    host = Host(HostConfig(device="cpu", num_pages=pool, warm_auto=0), progress=False)
    try:
        got, quarter = _chats(host, prompts, tokens)
    finally:
        host.shutdown()
    results = {"instances": n, "tokens": tokens, "pool_pages": pool, "pages_per_instance": per, "full": full,
               "quarter": quarter, "outputs_equal": got == want, "swap_vs_prefill": resume}
    print(json.dumps(results), flush=True)
    return results


def main() -> None:
    a = parse_args()
    entries = [standin_entry(n, f, a.step_ms / 1000, a.tokens) for n in a.instances for f in a.factors]
    real = real_entry(a.real, a.real_tokens, (4,) if a.quick else (4, 16, 64)) if a.real else None
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
        lines += ["", "| pages | swap out + in ms | re-prefill ms | MB |", "|---|---|---|---|"]
        lines += [f"| {r['pages']} | {r['swap_ms']} | {r['prefill_ms']} | {r['swap_mb']} |"
                  for r in real["swap_vs_prefill"]]
    a.json.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
