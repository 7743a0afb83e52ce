"""The paged Triton decode attention ("triton", gpu_backend/attention/triton_paged.py) against SDPA
(pages gathered into a padded copy every layer), on one GPU.

Three sections (the last two with each path under CUDA graphs, as the backend runs decode):
  parity: the compiled kernel against SDPA in float32 and bf16, every AttnSpec kind, GQA 1 / 4, a head
          dim of 80, split-KV and not (what tests/test_triton_attention.py's `gpu` test checks).
  kernel: one layer's `attend` of a decode batch (random cache, shuffled pages, page size 16, bf16),
          microseconds per call from a captured graph of 10 calls, for the 1B shape's heads (32 / 8 KV
          heads x 64) and Qwen3-0.6B's (16 / 8 x 128), batch 1..256 x context 128..8192; the max
          |difference| between the two paths; the Triton path's KV bytes read per second.
  decode: tokens/s of a random-weight Llama-3.2-1B-shaped model's greedy loop (backend_from_weights,
          CUDA graphs, bf16) with each path: prompts of 64 tokens + 64 new (the GPU kit's decode cell)
          and prompts of 1024 + 32 new; and how many greedy tokens the two paths agree on.

    python bench/triton_attention.py --json bench/triton_attention_h200.json      # GPU: ~3-5 min
    python bench/triton_attention.py --dry-run                                    # CPU: the script runs

`--dry-run` (`--quick`, as `python -m bench gpu --quick` passes it): tiny shapes on CPU through
Triton's interpreter (TRITON_INTERPRET=1, set by the script; numbers mean nothing; no graphs).
Writes the JSON and a markdown table next to it (same name, .md).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "--dry-run" in sys.argv or "--quick" in sys.argv:  # before triton is first imported (torch may import it)
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

HEADS = {"llama-1b": (32, 8, 64), "qwen3-0.6b": (16, 8, 128)}  # query heads, KV heads, head dim
PAGE = 16
DEADLINE = [math.inf]  # perf_counter() past which cells are skipped (--budget-s)


def out_of_time() -> bool:
    return time.perf_counter() > DEADLINE[0]


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def decode_reqs(batch: int, ctx: int, rng: np.random.Generator) -> tuple[list[Any], int]:
    """`batch` one-token decode requests of `ctx` tokens each (the new one included) on shuffled pages."""
    from gpu_backend.types import ForwardRequest

    per = math.ceil(ctx / PAGE)
    pages = rng.permutation(batch * per).reshape(batch, per)
    reqs = [ForwardRequest(pages=[int(p) for p in row], last_page_len=ctx - (per - 1) * PAGE, tokens=[1],
                           positions=[ctx - 1]) for row in pages]
    return reqs, batch * per


def time_attend(attn: Any, plan: Any, q: torch.Tensor, kv: torch.Tensor, reps: int) -> tuple[float, torch.Tensor]:
    """Microseconds per `attend` (a CUDA graph of 10 calls replayed `reps` times; eager on CPU)."""
    dev = q.device
    out = attn.attend(q, kv, plan)  # warm-up: compiles the kernel
    sync(dev)
    if dev.type != "cuda":
        t = time.perf_counter()
        for _ in range(reps):
            attn.attend(q, kv, plan)
        return (time.perf_counter() - t) / reps * 1e6, out
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        attn.attend(q, kv, plan)
    torch.cuda.current_stream(dev).wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            attn.attend(q, kv, plan)
    g.replay()
    sync(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    sync(dev)
    return start.elapsed_time(end) * 1e3 / (reps * 10), out


def sec_parity(dev: torch.device, dry: bool) -> dict[str, Any]:
    """The compiled kernel against SDPA: float32 (tolerance 1e-4) and bf16 (2e-2), GQA groups 1 / 4 and
    a head dim that is not a power of two, every AttnSpec kind, split and not; ragged lengths (1, a
    page +- 1, long) on shuffled pages. `ok` is False when any cell is off (see `worst`)."""
    from gpu_backend.attention import AttnSpec, SdpaAttention, build_plan
    from gpu_backend.attention.triton_paged import TritonAttention

    heads = [(4, 2, 16)] if dry else [(32, 8, 64), (8, 8, 128), (12, 4, 80)]
    lens = [1, 15, 17, 40] if dry else [1, 15, 16, 17, 300, 2000, 4096, 777]
    specs = {"global": AttnSpec(), "window": AttnSpec(local=True), "scale+softcap": AttnSpec(scale=0.37, softcap=1.5),
             "window+softcap": AttnSpec(local=True, softcap=3.0)}
    rng = np.random.default_rng(2)
    cells, ok = [], True
    for dtype in (torch.float32,) if dry else (torch.float32, torch.bfloat16):
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for h, kvh, d in heads:
            from gpu_backend.types import ForwardRequest

            per = [math.ceil(n / PAGE) for n in lens]
            pages = [int(p) for p in rng.permutation(sum(per))]
            reqs = []
            for n, k in zip(lens, per, strict=True):
                reqs.append(ForwardRequest(pages=pages[:k], last_page_len=n - (k - 1) * PAGE, tokens=[1],
                                           positions=[n - 1]))
                pages = pages[k:]
            kv = torch.randn(sum(per) * PAGE, 2, kvh, d, device=dev).to(dtype)
            q = torch.randn(len(lens), h + kvh, d, device=dev).to(dtype)[:, :h]
            for name, spec in specs.items():
                for splits in (None, 1, 8):
                    cell: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "heads": f"{h}/{kvh}x{d}",
                                            "spec": name, "splits": splits or "auto"}
                    try:
                        outs = [a.attend(q, kv, build_plan(reqs, PAGE, dev, h // kvh, a, num_pages=sum(per),
                                                           window=37), spec)
                                for a in (SdpaAttention(), TritonAttention(splits=splits))]
                        diff = (outs[0].float() - outs[1].float()).abs()
                        ref = outs[0].float().abs().max().item()
                        cell["max_abs_diff"] = diff.max().item()
                        cell["ok"] = bool(cell["max_abs_diff"] <= tol * max(1.0, ref))
                    except Exception as e:
                        cell["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                        cell["ok"] = False
                    ok &= cell["ok"]
                    cells.append(cell)
    worst = sorted(cells, key=lambda c: -c.get("max_abs_diff", math.inf))[:5]
    print(json.dumps({"parity_ok": ok, "worst": worst}), flush=True)
    return {"ok": ok, "cells": len(cells), "worst": worst, "failed": [c for c in cells if not c["ok"]]}


def sec_kernel(dev: torch.device, dtype: torch.dtype, dry: bool) -> list[dict[str, Any]]:
    from gpu_backend.attention import SdpaAttention, build_plan
    from gpu_backend.attention.triton_paged import TritonAttention

    heads = {"tiny": (4, 2, 16)} if dry else HEADS
    batches, ctxs = ((1, 4), (20, 70)) if dry else ((1, 8, 64, 256), (128, 512, 2048, 8192))
    rows = []
    rng = np.random.default_rng(0)
    for shape, (h, kvh, d) in heads.items():
        for b in batches:
            for ctx in ctxs:
                row: dict[str, Any] = {"shape": shape, "batch": b, "ctx": ctx}
                if out_of_time():
                    row["error"] = "skipped: budget"
                    rows.append(row)
                    continue
                try:
                    reqs, npages = decode_reqs(b, ctx, rng)
                    kv = torch.randn(npages * PAGE, 2, kvh, d, device=dev, dtype=dtype)
                    q = torch.randn(b, h + kvh, d, device=dev, dtype=dtype)[:, :h]  # a view, as the model's
                    tri = TritonAttention()
                    outs = {}
                    for name, attn in (("sdpa", SdpaAttention()), ("triton", tri)):
                        plan = build_plan(reqs, PAGE, dev, h // kvh, attn, num_pages=npages,
                                          kv_slots=attn.graph_slots(ctx), static=True)
                        row[f"{name}_us"], outs[name] = time_attend(attn, plan, q, kv, 3 if dry else 20)
                    row["speedup"] = row["sdpa_us"] / row["triton_us"]
                    row["max_abs_diff"] = (outs["sdpa"].float() - outs["triton"].float()).abs().max().item()
                    row["splits"] = tri.num_splits(b, kvh, tri.graph_slots(ctx), dev)
                    kv_bytes = b * ctx * kvh * d * 2 * kv.element_size()
                    row["triton_kv_GBps"] = kv_bytes / (row["triton_us"] * 1e-6) / 1e9
                    del kv, q, outs
                except Exception as e:  # one failing cell must not lose the others
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def model(dev: torch.device, dtype: torch.dtype, dry: bool, num_pages: int) -> Any:
    """A random-weight Llama-3.2-1B-shaped backend (tiny with --dry-run), SDPA, graphs on CUDA."""
    from gpu_backend.attention import SdpaAttention
    from gpu_backend.build import backend_from_weights
    from gpu_backend.loading.model_files import GPT2_PATTERN, TokenizerSpec
    from gpu_backend.loading.tokenizer import _unicode_to_byte
    from gpu_backend.models.config import ModelConfig

    size = dict(num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                vocab_size=512) if dry else dict(num_layers=16, hidden_size=2048, intermediate_size=8192,
                                                 num_heads=32, num_kv_heads=8, head_dim=64, vocab_size=128256)
    cfg = ModelConfig(arch="llama", rms_eps=1e-5, rope_theta=500000.0, max_position=8192, tie_embeddings=True,
                      **size)  # type: ignore[arg-type]
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * std).to(dtype)

    hid, d, kvh, inter, v = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size
    ones = torch.ones(hid, device=dev, dtype=dtype)
    w = {"model.embed_tokens.weight": rnd(v, hid, std=1.0), "model.norm.weight": ones.clone()}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone(),
              p + "self_attn.q_proj.weight": rnd(cfg.num_heads * d, hid), p + "self_attn.k_proj.weight": rnd(kvh * d, hid),
              p + "self_attn.v_proj.weight": rnd(kvh * d, hid), p + "self_attn.o_proj.weight": rnd(hid, cfg.num_heads * d),
              p + "mlp.gate_proj.weight": rnd(inter, hid), p + "mlp.up_proj.weight": rnd(inter, hid),
              p + "mlp.down_proj.weight": rnd(hid, inter)}
    chars = {b: c for c, b in _unicode_to_byte().items()}
    toks = [chars[i] for i in range(256)] + [
        chars[0xFF] + chars[0xFE] + chars[0xFD] + chars[(i >> 16) & 255] + chars[(i >> 8) & 255] + chars[i & 255]
        for i in range(256, v)]
    spec = TokenizerSpec(tokens=toks, special={}, pattern=GPT2_PATTERN, chat_template="", bos_token_id=None,
                         eos_token_id=None, pad_token_id=None, stop_tokens=[])
    be = backend_from_weights(cfg, w, spec, "llama-1b-random", device=dev, dtype=dtype, page_size=PAGE,
                              num_pages=num_pages, attention=SdpaAttention(), cuda_graphs=dev.type == "cuda")
    return be


def variant(be: Any, attention: str) -> Any:
    """The same model and cache with another attention path (graphs on CUDA, as the base)."""
    from gpu_backend import TorchBackend
    from gpu_backend.build import make_attention
    from gpu_backend.cuda_graphs import DecodeGraphs

    attn = make_attention(attention)
    graphs = None
    if be.graphs is not None:
        graphs = DecodeGraphs(be.model, be.cache, attn, be.info.page_size, scratch_page=be.info.num_pages)
    return TorchBackend(be.model, be.tokenizer, be.info, be.cache, attn, graphs)


def loop_s(be: Any, seqs: list[list[int]], n: int) -> tuple[float, list[list[int]]]:
    dev = be.model.device
    sync(dev)
    t = time.perf_counter()
    out = be.generate_batch(seqs, n, stop_tokens=[])
    sync(dev)
    return time.perf_counter() - t, out


def sec_decode(dev: torch.device, dtype: torch.dtype, dry: bool) -> dict[str, Any]:
    cells = [(64, 64, (1, 8, 64, 256)), (1024, 32, (1, 8, 64))] if not dry else [(16, 6, (1, 3))]
    pages = max(max(bs) * math.ceil((p + n) / PAGE) for p, n, bs in cells) + 8
    base = model(dev, dtype, dry, pages)
    res: dict[str, Any] = {"tokens_per_s": {}, "agree": {}}
    rng = np.random.default_rng(1)
    for prompt, new, batches in cells:
        for b in batches:
            key = f"{b}x{prompt}+{new}"
            seqs = [[int(t) for t in rng.integers(300, base.info.vocab_size, prompt)] for _ in range(b)]
            toks = {}
            for attention in ("sdpa", "triton"):
                if out_of_time():
                    res["tokens_per_s"].setdefault(attention, {})[key] = "skipped: budget"
                    continue
                try:
                    be = variant(base, attention)
                    loop_s(be, seqs, new)  # warm-up: graph capture, kernel compiles
                    best = math.inf
                    for _ in range(1 if dry else 2):
                        full, toks[attention] = loop_s(be, seqs, new)
                        first, _ = loop_s(be, seqs, 1)
                        best = min(best, max(full - first, 1e-9))
                    res["tokens_per_s"].setdefault(attention, {})[key] = round(b * (new - 1) / best, 1)
                except Exception as e:
                    res["tokens_per_s"].setdefault(attention, {})[key] = f"error: {type(e).__name__}: {str(e)[:300]}"
                print(key, attention, res["tokens_per_s"][attention][key], flush=True)
            if len(toks) == 2:
                same = sum(x == y for a, c in zip(toks["sdpa"], toks["triton"], strict=True)
                           for x, y in zip(a, c, strict=True))
                res["agree"][key] = f"{same}/{sum(len(a) for a in toks['sdpa'])}"
    return res


def markdown(res: dict[str, Any]) -> str:
    par = res.get("parity", {})
    out = [f"# Triton paged decode attention vs SDPA ({res['device']}, {res['dtype']})", "",
           f"torch {res['torch']}, triton {res['triton']}; `{res['command']}`", "",
           f"Parity (compiled kernel vs SDPA, fp32 and bf16, {par.get('cells', 0)} cells): "
           f"{'ok' if par.get('ok') else 'FAILED: ' + json.dumps(par.get('failed', [])[:5])}; worst "
           f"{json.dumps(par.get('worst', [])[:1])}", "",
           "## One layer's attend (us per call, CUDA graph)", "",
           "| shape | batch | ctx | sdpa | triton | speedup | splits | triton KV GB/s | max abs diff |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in res["kernel"]:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['batch']} | {r['ctx']} | {r['error']} | | | | | |")
            continue
        out.append(f"| {r['shape']} | {r['batch']} | {r['ctx']} | {r['sdpa_us']:.1f} | {r['triton_us']:.1f} | "
                   f"{r['speedup']:.2f}x | {r['splits']} | {r['triton_kv_GBps']:.0f} | {r['max_abs_diff']:.2g} |")
    dec = res.get("decode", {})
    if dec:
        keys = list(next(iter(dec["tokens_per_s"].values())).keys())
        out += ["", "## Greedy decode, random-weight 1B shape (tokens/s, CUDA graphs)", "",
                "| attention | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
        for attn, row in dec["tokens_per_s"].items():
            out.append(f"| {attn} | " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
        out.append("| tokens equal | " + " | ".join(dec["agree"].get(k, "") for k in keys) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default="out/triton_attention.json")
    ap.add_argument("--dry-run", "--quick", action="store_true",
                    help="tiny shapes on CPU in Triton's interpreter (the numbers mean nothing)")
    ap.add_argument("--sections", default="parity,kernel,decode")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="skip the cells left after this many seconds (the JSON keeps what ran)")
    args, rest = ap.parse_known_args(argv)
    if rest:  # `python -m bench gpu -- ARGS` passes the kit's own arguments to every step of the suite
        print(f"triton_attention: ignoring {rest}", file=sys.stderr)
    import triton

    dry = args.dry_run
    dev = torch.device("cpu" if dry else "cuda")
    dtype = torch.float32 if dry else torch.bfloat16
    if dry and not triton.knobs.runtime.interpret:
        raise SystemExit("--dry-run runs the kernel in Triton's interpreter: TRITON_INTERPRET=1 before triton loads")
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                           "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__,
                           "triton": triton.__version__, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]])}
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    sections = args.sections.split(",")
    t0 = time.perf_counter()
    DEADLINE[0] = t0 + args.budget_s
    if "parity" in sections:
        res["parity"] = sec_parity(dev, dry)
        path.write_text(json.dumps(res, indent=1))
    if "kernel" in sections:
        res["kernel"] = sec_kernel(dev, dtype, dry)
        path.write_text(json.dumps(res, indent=1))
    if "decode" in sections:
        res["decode"] = sec_decode(dev, dtype, dry)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    path.write_text(json.dumps(res, indent=1))
    res.setdefault("kernel", [])
    md = markdown(res)
    path.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
