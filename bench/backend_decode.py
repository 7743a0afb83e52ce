"""Decode throughput of gpu_backend vs transformers' generate, same weights, same prompts, one run.

    python bench/backend_decode.py --json bench/results/backend_decode.json [--quick]

Measures decode tokens/s (prefill excluded: the clock starts when the first token is out) at each
batch size, alternating all series `--repeats` times and keeping each one's best, so load from other
processes hurts all alike. The headline pair is ours in `--dtype` (default bfloat16: this CPU has
native bf16) against transformers in `--hf-dtype` (default float32 on CPU, the issue's baseline);
the equal-dtype pairs (ours fp32, transformers bf16) are measured too and reported beside it. Prints a markdown table, the bytes of weights a decode step
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
from gpu_backend.loading.loader import default_model_path

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


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# series: key -> (kind, dtype); "ours" and "transformers" are the headline pair
Series = dict[str, tuple[str, torch.dtype]]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="write results here")
    ap.add_argument("--model", default=None, help="GGUF file or HF dir (default: SmolLM2-135M GGUF)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", help="our compute dtype (the JSON's 'ours')")
    ap.add_argument("--hf-dtype", default=None,
                    help="transformers' dtype (the JSON's 'transformers'); default float32 on CPU, bfloat16 on CUDA")
    ap.add_argument("--no-same-dtype", action="store_true",
                    help="skip the equal-dtype series (ours at the baseline's dtype and vice versa)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): batches 1 and 2, 4 new tokens, 1 repeat")
    args = ap.parse_args()
    if args.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(batches="1,2", new_tokens=4, repeats=1)
        args = ap.parse_args()
    return args


def make_series(args: argparse.Namespace) -> Series:
    """The headline pair, plus the equal-dtype pairs unless --no-same-dtype (or the dtypes agree)."""
    cuda = args.device.startswith("cuda")
    ours_dt = getattr(torch, args.dtype)
    hf_dt = getattr(torch, args.hf_dtype or ("bfloat16" if cuda else "float32"))
    series = {"ours": ("ours", ours_dt), "transformers": ("hf", hf_dt)}
    if not args.no_same_dtype and ours_dt != hf_dt:
        series[f"ours_{DTYPE_NAMES[hf_dt]}"] = ("ours", hf_dt)
        series[f"transformers_{DTYPE_NAMES[ours_dt]}"] = ("hf", ours_dt)
    return series


def load_models(args: argparse.Namespace, series: Series) -> tuple[dict, dict, float]:
    """(our backends by dtype, transformers models by dtype, seconds to load the headline backend)."""
    ours_dt = series["ours"][1]
    t = time.perf_counter()
    backends = {ours_dt: load_backend(args.model, device=args.device, dtype=ours_dt, num_pages=4096,
                                      progress=False)}
    load_s = time.perf_counter() - t
    for _, dt in series.values():
        if dt not in backends:
            backends[dt] = load_backend(args.model, device=args.device, dtype=dt, num_pages=4096, progress=False)
    hf = {dt: load_hf(args.model, args.device, dt) for kind, dt in series.values() if kind == "hf"}
    return backends, hf, load_s


def measure_batches(args: argparse.Namespace, series: Series, backends: dict, hf: dict,
                    batches: list[int]) -> dict:
    """Decode tok/s per series and batch size: the best of --repeats alternating runs, after a warm-up."""
    main_backend = backends[series["ours"][1]]
    results: dict = {key: {} for key in series}

    def measure(key: str, seqs: list[list[int]], n: int) -> float:
        kind, dt = series[key]
        if kind == "ours":
            return ours_decode(backends[dt], seqs, n)
        return hf_decode(hf[dt], seqs, n, args.device)

    for b in batches:
        seqs = prompts(main_backend, b)
        for key in series:
            measure(key, seqs, 3)  # warm-up
        best = dict.fromkeys(series, 0.0)
        for _ in range(args.repeats):  # alternate, so load from other processes hits all series alike
            for key in series:
                best[key] = max(best[key], measure(key, seqs, args.new_tokens))
        for key in series:
            results[key][str(b)] = round(best[key], 2)
        print(f"batch {b}: " + ", ".join(f"{k} {v:.1f}" for k, v in best.items()) + " tok/s", flush=True)
    return results


def meta(args: argparse.Namespace, series: Series, main_backend, wbytes: dict[str, int], bw: float,
         load_s: float) -> dict:
    return {
        "model": main_backend.info.name, "device": args.device,
        "dtypes": {key: DTYPE_NAMES[dt] for key, (_, dt) in series.items()},
        "threads": torch.get_num_threads(), "new_tokens": args.new_tokens,
        "prompt_tokens": len(prompts(main_backend, 1)[0]),
        "weight_bytes_per_decode_step": wbytes, "copy_bandwidth_bytes_per_s": round(bw),
        "batch1_bound_steps_per_s": {k: round(bw / 2 / v, 1) for k, v in wbytes.items()},
        "load_seconds": round(load_s, 2),
    }


def write_results(path: str, results: dict) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return out


def print_table(results: dict, series: Series, batches: list[int]) -> None:
    """The markdown table of tok/s per batch, and the equal-dtype ratios where measured."""
    heads = [f"{k} ({DTYPE_NAMES[dt]})" for k, (_, dt) in series.items()]
    print("\n| batch | " + " | ".join(heads) + " | ours / transformers |")
    print("|---" * (len(series) + 2) + "|")
    for b in batches:
        row = [f"{results[k][str(b)]:.1f}" for k in series]
        ratio = results["ours"][str(b)] / results["transformers"][str(b)]
        print(f"| {b} | " + " | ".join(row) + f" | {ratio:.2f}x |")
    if len(series) > 2:
        ours_name, hf_name = DTYPE_NAMES[series["ours"][1]], DTYPE_NAMES[series["transformers"][1]]
        print("\nequal dtype: " + ", ".join(
            f"batch {b}: {hf_name} {results[f'ours_{hf_name}'][str(b)] / results['transformers'][str(b)]:.2f}x"
            f" / {ours_name} {results['ours'][str(b)] / results[f'transformers_{ours_name}'][str(b)]:.2f}x"
            for b in batches))


def print_bounds(wbytes: dict[str, int], bw: float, load_s: float, out: Path) -> None:
    for k, v in wbytes.items():
        print(f"weights read per decode step ({k}): {v / 1e6:.0f} MB -> batch-1 bound ~{bw / 2 / v:.0f} steps/s")
    print(f"measured copy bandwidth: {bw / 1e9:.1f} GB/s (read+write; a step reads weights, so bound = bw/2 / bytes)")
    print(f"load_backend: {load_s:.1f} s; wrote {out}")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    series = make_series(args)
    backends, hf, load_s = load_models(args, series)
    batches = [int(b) for b in args.batches.split(",")]
    results = measure_batches(args, series, backends, hf, batches)
    wbytes = {DTYPE_NAMES[dt]: be.model.weight_bytes() for dt, be in backends.items()}
    bw = copy_bandwidth(args.device)
    results["meta"] = meta(args, series, backends[series["ours"][1]], wbytes, bw, load_s)
    out = write_results(args.json, results)
    print_table(results, series, batches)
    print_bounds(wbytes, bw, load_s, out)


if __name__ == "__main__":
    main()
