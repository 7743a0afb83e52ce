"""Decode throughput of gpu_backend vs transformers' generate, same weights, same prompts, one run.

    python bench/backend_decode.py --json bench/results/backend_decode.json

Measures decode tokens/s (prefill excluded: the clock starts when the first token is out) at each
batch size, alternating ours / transformers `--repeats` times and keeping each side's best, so load
from other processes hurts both alike. Prints a markdown table, the bytes of weights a decode step
reads and the machine's measured copy bandwidth (the batch-1 bound is bandwidth / weight bytes).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from gpu_backend import ForwardRequest, OutputSpec, SamplerParams, load_backend
from gpu_backend.loader import default_model_path

QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in simple terms.", "Write a haiku about rain.",
    "How do airplanes fly?", "Give me three tips for learning Python.", "What causes the seasons on Earth?",
    "Summarize the plot of Hamlet.", "Why is the sky blue?",
]


def prompts(backend, batch: int) -> list[list[int]]:
    tok = backend.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]))
           for i in range(batch)]
    n = min(len(x) for x in ids)
    return [x[:n] for x in ids]  # equal lengths: transformers' batch needs no padding


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def ours_decode(backend, seqs: list[list[int]], new_tokens: int) -> float:
    """Tokens/s of the decode steps (greedy, no stop tokens), pages owned by this loop."""
    ps = backend.info.page_size
    need = math.ceil((len(seqs[0]) + new_tokens) / ps)
    pages = [list(range(i * need, (i + 1) * need)) for i in range(len(seqs))]
    greedy = [OutputSpec(index=0, sample=SamplerParams())]
    lens = [len(s) for s in seqs]
    nxt = [list(s) for s in seqs]
    t0 = 0.0
    for step in range(new_tokens):
        if step == 1:
            sync(backend.info.device)
            t0 = time.perf_counter()
        reqs = []
        for i in range(len(seqs)):
            used = math.ceil(lens[i] / ps)
            n = len(nxt[i])
            reqs.append(ForwardRequest(
                pages=pages[i][:used], last_page_len=lens[i] - (used - 1) * ps, tokens=nxt[i],
                positions=list(range(lens[i] - n, lens[i])),
                outputs=[OutputSpec(index=n - 1, sample=SamplerParams())] if n > 1 else greedy,
            ))
        res = backend.forward(reqs)
        for i, r in enumerate(res):
            nxt[i] = [r[0].token]
            lens[i] += 1
    sync(backend.info.device)
    return len(seqs) * (new_tokens - 1) / (time.perf_counter() - t0)


def hf_decode(model, seqs: list[list[int]], new_tokens: int, device: str) -> float:
    import transformers

    stamps: list[float] = []

    class Clock(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())  # called once per step, after that step's forward
            return scores

    ids = torch.tensor(seqs, device=device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=transformers.LogitsProcessorList([Clock()]))
    sync(device)
    end = time.perf_counter()
    # stamps[0] is right after the prefill forward; the first token is out then
    return len(seqs) * (new_tokens - 1) / (end - stamps[0])


def copy_bandwidth(device: str) -> float:
    a = torch.ones(64 * 2**20, dtype=torch.float32, device=device)  # 256 MiB
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(5):
        sync(device)
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best  # bytes read + written


def load_hf(model_arg: str | None, device: str, dtype: torch.dtype):
    import transformers

    if model_arg is None or model_arg.endswith(".gguf"):
        path = default_model_path() if model_arg is None else Path(model_arg)
        m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        m = transformers.AutoModelForCausalLM.from_pretrained(model_arg, dtype=torch.float32)
    return m.to(device=device, dtype=dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    t = time.perf_counter()
    backend = load_backend(args.model, device=args.device, dtype=dtype, num_pages=4096, progress=False)
    load_s = time.perf_counter() - t
    hf = load_hf(args.model, args.device, dtype)
    batches = [int(b) for b in args.batches.split(",")]
    results: dict = {"ours": {}, "transformers": {}}
    for b in batches:
        seqs = prompts(backend, b)
        ours_decode(backend, seqs, 3)  # warm-up
        hf_decode(hf, seqs, 3, args.device)
        best_o = best_h = 0.0
        for _ in range(args.repeats):
            best_o = max(best_o, ours_decode(backend, seqs, args.new_tokens))
            best_h = max(best_h, hf_decode(hf, seqs, args.new_tokens, args.device))
        results["ours"][str(b)] = round(best_o, 2)
        results["transformers"][str(b)] = round(best_h, 2)
        print(f"batch {b}: ours {best_o:.1f} tok/s, transformers {best_h:.1f} tok/s", flush=True)
    wbytes = backend.model.weight_bytes()
    bw = copy_bandwidth(args.device)
    results["meta"] = {
        "model": backend.info.name, "device": args.device, "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "new_tokens": args.new_tokens, "prompt_tokens": len(prompts(backend, 1)[0]),
        "weight_bytes_per_decode_step": wbytes, "copy_bandwidth_bytes_per_s": round(bw),
        "batch1_bound_steps_per_s": round(bw / 2 / wbytes, 1), "load_seconds": round(load_s, 2),
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("\n| batch | ours tok/s | transformers tok/s | speedup |\n|---|---|---|---|")
    for b in batches:
        o, h = results["ours"][str(b)], results["transformers"][str(b)]
        print(f"| {b} | {o:.1f} | {h:.1f} | {o / h:.2f}x |")
    print(f"\nweights read per decode step: {wbytes / 1e6:.0f} MB ({results['meta']['dtype']})")
    print(f"measured copy bandwidth: {bw / 1e9:.1f} GB/s (read+write); batch-1 bound ~{bw / 2 / wbytes:.0f} "
          "steps/s (each step streams the weights once)")
    print(f"load_backend: {load_s:.1f} s; wrote {out}")


if __name__ == "__main__":
    main()
