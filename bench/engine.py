"""The backend in the host process vs in an engine process (`--engine inproc` vs `--engine process`).

Usage: python bench/engine.py --json OUT [--instances 1 16 64] [--tokens 32] [--repeats 3] [--skip-model] [--quick]

Both sides in the same run, interleaved (A B A B ...), medians of `--repeats`:
- `standin`: the host in front of the stand-in backend sleeping `--step-ms` per batch (as in
  bench/host_scale.py), `text_completion` greedy, N instances at once; inproc = StandInBackend on
  the scheduler thread, process = the same stand-in in an engine process (gpu_backend/engine/client.py).
  efficiency = tok/s / ideal, ideal = N * tokens / ((tokens + 1) * step). This isolates what the
  transport costs per step (and what leaving the host's GIL gives back).
- `model`: the real default model on CPU (float32), same inferlet, N instances; tok/s of the whole
  burst, and the backend's own mean time per batch (scheduler stats), which includes the
  transport for the process engine.
- `roundtrip_us`: one decode-step request through ProcessBackend to a stand-in with no delay (the
  bare cost of a batch crossing the process boundary and back).
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from common import Run, compile_inferlet, settle

from gpu_backend.engine.client import EngineSpec, ProcessBackend, start_engines
from gpu_backend.standin import StandInBackend
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host import Host, HostConfig

PROMPT = "Write a story about a lighthouse."


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--instances", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--model-instances", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-model", action="store_true", help="only the stand-in part")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 1 and 4 instances (model: 1 and 2), 8 tokens, 1 repeat, "
                         "200 round trips")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=[1, 4], model_instances=[1, 2], tokens=8, repeats=1)
        opts = ap.parse_args()
    return opts


def burst(host: Host, program: str, n: int, tokens: int) -> tuple[float, str]:
    """Launch n text_completion instances at once; (tok/s over the whole burst, one output)."""
    args = ["--prompt", PROMPT, "--max-tokens", str(tokens)]
    t0 = time.perf_counter()
    runs = [Run(host, program, args) for _ in range(n)]
    outs = []
    for r in runs:
        end = r.finish(900)
        if end.event != "completed":
            raise RuntimeError(f"{end.event}: {end.message[:200]}")
        outs.append(end.message)
    wall = time.perf_counter() - t0
    if len(set(outs)) != 1:
        raise RuntimeError("greedy outputs differ between instances")
    return n * tokens / wall, outs[0]


def roundtrip_us(n: int = 2000) -> float:
    b = ProcessBackend(EngineSpec(standin=True, page_size=16, num_pages=64))
    try:
        req = ForwardRequest(pages=[0], last_page_len=1, tokens=[5], positions=[0],
                             outputs=[OutputSpec(0, SamplerParams())], checked=True)
        for _ in range(200):
            b.forward([req])
        t0 = time.perf_counter()
        for _ in range(n):
            b.forward([req])
        return round((time.perf_counter() - t0) / n * 1e6, 1)
    finally:
        b.close()


def standin_part(opts: argparse.Namespace) -> dict[str, Any]:
    step = opts.step_ms / 1000
    inproc = Host(HostConfig(), backend=StandInBackend(page_size=16, num_pages=16384, delay_s=step), progress=False)
    proc = Host(HostConfig(), engines=start_engines(EngineSpec(standin=True, page_size=16, num_pages=16384,
                                                               standin_delay_s=step)))
    hosts = {"inproc": inproc, "process": proc}
    try:
        progs = {k: compile_inferlet(h, "text_completion") for k, h in hosts.items()}
        out: dict[str, Any] = {}
        for n in opts.instances:
            ideal = n * opts.tokens / ((opts.tokens + 1) * step)
            samples: dict[str, list[float]] = {k: [] for k in hosts}
            for k, h in hosts.items():  # warm-up burst (pool slots, caches)
                burst(h, progs[k], n, opts.tokens)
            for _ in range(opts.repeats):
                for k, h in hosts.items():
                    for other, oh in hosts.items():  # neither host refills or frees during a burst
                        settle(oh, progs[other], n)
                    samples[k].append(burst(h, progs[k], n, opts.tokens)[0])
            out[str(n)] = {k: {"tok_s": round(statistics.median(v), 1),
                               "efficiency": round(statistics.median(v) / ideal, 3)} for k, v in samples.items()}
            print("standin", n, json.dumps(out[str(n)]), flush=True)
        return out
    finally:
        for h in hosts.values():
            h.shutdown()


def model_part(opts: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(device="cpu", dtype="float32", num_pages=1024)
    inproc = Host(HostConfig(engine="inproc", **cfg), progress=False)  # type: ignore[arg-type]
    proc = Host(HostConfig(engine="process", **cfg), progress=False)  # type: ignore[arg-type]
    hosts = {"inproc": inproc, "process": proc}
    try:
        progs = {k: compile_inferlet(h, "text_completion") for k, h in hosts.items()}
        out: dict[str, Any] = {}
        for n in opts.model_instances:
            texts = {k: burst(h, progs[k], n, opts.tokens)[1] for k, h in hosts.items()}  # warm-up
            samples: dict[str, list[float]] = {k: [] for k in hosts}
            step_ms: dict[str, list[float]] = {k: [] for k in hosts}
            for _ in range(opts.repeats):
                for k, h in hosts.items():
                    for other, oh in hosts.items():
                        settle(oh, progs[other], n)
                    before = h.scheduler.stats.as_dict()
                    samples[k].append(burst(h, progs[k], n, opts.tokens)[0])
                    after = h.scheduler.stats.as_dict()
                    b = after["batches"] - before["batches"]
                    step_ms[k].append((after["mean_backend_ms"] * after["batches"]
                                       - before["mean_backend_ms"] * before["batches"]) / max(b, 1))
            out[str(n)] = {k: {"tok_s": round(statistics.median(samples[k]), 2),
                               "backend_ms_per_batch": round(statistics.median(step_ms[k]), 2)} for k in hosts}
            out[str(n)]["same_text"] = texts["inproc"] == texts["process"]
            print("model", n, json.dumps(out[str(n)]), flush=True)
        return out
    finally:
        for h in hosts.values():
            h.shutdown()


def table(res: dict[str, Any]) -> str:
    lines = [f"# bench/engine.py: backend in the host process vs in an engine process ({res['tokens']} tokens "
             f"per instance, medians of {res['repeats']} interleaved runs)", "",
             f"Round trip of one decode-step batch through the engine process (stand-in, no delay): "
             f"{res['roundtrip_us']} us", "",
             f"## stand-in backend, {res['step_ms']:g} ms per batch, `text_completion` (efficiency = tok/s / ideal)", "",
             "| instances | inproc tok/s | process tok/s | inproc eff. | process eff. |", "|---|---|---|---|---|"]
    for n, v in res["standin"].items():
        lines.append(f"| {n} | {v['inproc']['tok_s']} | {v['process']['tok_s']} | {v['inproc']['efficiency']} | "
                     f"{v['process']['efficiency']} |")
    if res.get("model"):
        lines += ["", "## SmolLM2-135M on CPU (float32), `text_completion`", "",
                  "| instances | inproc tok/s | process tok/s | inproc ms/batch | process ms/batch | same text |",
                  "|---|---|---|---|---|---|"]
        for n, v in res["model"].items():
            lines.append(f"| {n} | {v['inproc']['tok_s']} | {v['process']['tok_s']} | "
                         f"{v['inproc']['backend_ms_per_batch']} | {v['process']['backend_ms_per_batch']} | "
                         f"{v['same_text']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    opts = parse_args()
    res: dict[str, Any] = {"tokens": opts.tokens, "repeats": opts.repeats, "step_ms": opts.step_ms,
                           "roundtrip_us": roundtrip_us(200 if opts.quick else 2000)}
    print("roundtrip_us", res["roundtrip_us"], flush=True)
    res["standin"] = standin_part(opts)
    if not opts.skip_model:
        res["model"] = model_part(opts)
    opts.json.write_text(json.dumps(res, indent=1))
    opts.json.with_suffix(".md").write_text(table(res))
    print(table(res))


if __name__ == "__main__":
    main()
