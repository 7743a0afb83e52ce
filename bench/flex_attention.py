"""FlexAttention over the pages in place vs SDPA over gathered pages: one forward step, same run.

    python bench/flex_attention.py --json bench/flex_attention.json [--quick]

Both paths share one model and one KV cache (filled with random K/V: attention's speed does not
depend on the values), so they compute the same logits; the script checks that they agree. For each
case it times a full forward step of the default model (decode: one new token per request after
`--ctx` cached tokens, every request on its own pages; prefill: one prompt of `--prefill` tokens),
alternating the two paths `--repeats` times and keeping each one's best, so load from other
processes hurts both alike. The first flex call of each shape compiles it: that time is reported
as `flex_first_s` (a cold compile: the script points inductor at a fresh cache directory unless
`--warm-cache`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch

from gpu_backend import ForwardRequest, OutputSpec, TorchBackend, load_backend
from gpu_backend.attention.flex import FlexAttention


def decode_batch(batch: int, ctx: int, ps: int, token: int) -> list[ForwardRequest]:
    """`batch` one-token requests after `ctx` cached tokens, request i on pages [i*need, (i+1)*need)."""
    need = math.ceil((ctx + 1) / ps)
    return [ForwardRequest(pages=list(range(i * need, (i + 1) * need)), last_page_len=ctx + 1 - (need - 1) * ps,
                           tokens=[token], positions=[ctx], outputs=[OutputSpec(index=0)]) for i in range(batch)]


def prefill_batch(n: int, ps: int, tokens: list[int]) -> list[ForwardRequest]:
    need = math.ceil(n / ps)
    toks = (tokens * (n // len(tokens) + 1))[:n]
    return [ForwardRequest(pages=list(range(need)), last_page_len=n - (need - 1) * ps, tokens=toks,
                           positions=list(range(n)), outputs=[OutputSpec(index=n - 1)])]


def timed(be: TorchBackend, reqs: list[ForwardRequest]) -> tuple[float, torch.Tensor]:
    t = time.perf_counter()
    out = torch.cat(be.logits(reqs))
    return time.perf_counter() - t, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--ctx", default="128,1024", help="cached tokens per request in the decode cases")
    ap.add_argument("--prefill", type=int, default=512, help="prompt length of the prefill case")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--warm-cache", action="store_true", help="keep inductor's on-disk cache (no cold compiles)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): batch 1, 32 cached tokens, a 32-token prefill, 1 repeat")
    a = ap.parse_args(argv)
    if a.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(batches="1", ctx="32", prefill=32, repeats=1)
        a = ap.parse_args(argv)
    if a.warm_cache:
        return run(a)
    with tempfile.TemporaryDirectory(prefix="flex-bench-inductor-") as d:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
        return run(a)


def run(a: argparse.Namespace) -> int:
    batches = [int(x) for x in a.batches.split(",")]
    ctxs = [int(x) for x in a.ctx.split(",")]
    ps = a.page_size
    pages = max(max(batches) * math.ceil((max(ctxs) + 1) / ps), math.ceil(a.prefill / ps))
    sdpa = load_backend(device="cpu", dtype=torch.float32, page_size=ps, num_pages=pages, progress=False)
    flex = TorchBackend(sdpa.model, sdpa.tokenizer, sdpa.info, sdpa.cache, FlexAttention())
    torch.manual_seed(0)
    sdpa.cache.data.normal_()
    tok = sdpa.tokenizer.encode("The quick brown fox jumps over the lazy dog.")

    cases = [(f"decode b={b} ctx={c}", decode_batch(b, c, ps, tok[0])) for c in ctxs for b in batches]
    cases.append((f"prefill {a.prefill} tokens", prefill_batch(a.prefill, ps, tok)))
    results = []
    for name, reqs in cases:
        first, flex_out = timed(flex, reqs)
        best = {"sdpa": math.inf, "flex": math.inf}
        worst_diff, scale = 0.0, flex_out.abs().max().item()
        for _ in range(a.repeats):
            for label, be in (("sdpa", sdpa), ("flex", flex)):
                dt, out = timed(be, reqs)
                best[label] = min(best[label], dt)
                if label == "sdpa":
                    worst_diff = max(worst_diff, (out - flex_out).abs().max().item())
        r = {"case": name, "batch": len(reqs), "sdpa_s": best["sdpa"], "flex_s": best["flex"],
             "flex_speedup": best["sdpa"] / best["flex"], "flex_first_s": first,
             "max_abs_logit_diff": worst_diff, "max_abs_logit": scale}
        results.append(r)
        print(f"{name:28s} sdpa {best['sdpa'] * 1e3:8.1f} ms  flex {best['flex'] * 1e3:8.1f} ms  "
              f"x{r['flex_speedup']:.2f}  first flex call {first:.1f} s  |diff| {worst_diff:.2g} of {scale:.3g}",
              flush=True)
    result = {
        "results": results,
        "config": {"device": "cpu", "dtype": "float32", "threads": torch.get_num_threads(), "page_size": ps,
                   "ctx": ctxs, "prefill": a.prefill, "repeats": a.repeats, "cache_pages": pages,
                   "cold_compile": not a.warm_cache,
                   "model": sdpa.info.name, "torch": torch.__version__},
    }
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
