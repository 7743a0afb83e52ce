"""Service levels under long prompts: running decodes' TPOT while a long prompt prefills, chunked
(`--prefill-chunk`, host/batching/chunks.py) against unchunked (the baseline) in the same run.

Usage: python bench/qos.py --json OUT [--chunks 0 128 256 512 1024] [--prompt 4096] [--decodes 16]
                           [--step-ms 10] [--token-us 20] [--real] [--real-prompt 1024] [--quick]

On the scheduler alone (no instances): `--decodes` host-side loops run; once steady, one prompt of
`--prompt` tokens arrives (a host-side loop too). For each batch the decodes' tokens come out at the
batch's end, so a decode's gap between two tokens is the time between two batch ends. Reported per
chunk size (0 = unchunked): the steady TPOT (median before the prompt), over the window from the
prompt's arrival to its first token the longest gap and the mean gap, both as ratios of the steady
TPOT (issue 52's targets: <= 3 and <= 1.5), and the prompt's time to first token (what chunking
costs it). Backends: the stand-in with a step of a fixed `--step-ms` plus `--token-us` per token
(new tokens of the batch), and with `--real` the default model on CPU (`--real-prompt` tokens: a
4,096-token prefill there takes minutes). Writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from gpu_backend.standin import StandInBackend
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host.batching.generation import Generation, StopRules
from host.batching.policy import AdaptivePolicy
from host.batching.scheduler import Scheduler
from host.state.pages import InstancePages, PageManager

PS = 16


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 128, 256, 512, 1024],
                    help="--prefill-chunk values (0 = unchunked, the baseline)")
    ap.add_argument("--prompt", type=int, default=4096, help="the long prompt's tokens (stand-in)")
    ap.add_argument("--decodes", type=int, default=16, help="decodes running while it arrives")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the stand-in's fixed time per batch")
    ap.add_argument("--token-us", type=float, default=20.0, help="the stand-in's time per new token in a batch")
    ap.add_argument("--real", action="store_true", help="also the default model on CPU")
    ap.add_argument("--real-chunks", type=int, nargs="+", default=[0, 16, 64, 256], help="chunks for --real")
    ap.add_argument("--real-prompt", type=int, default=1024, help="the long prompt's tokens with --real")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): a 512-token prompt, 4 decodes")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(chunks=[0, 128], prompt=512, decodes=4, step_ms=2.0, token_us=20.0,
                        real_chunks=[0, 64], real_prompt=128)
        opts = ap.parse_args()
    return opts


class Ends:
    """Each batch's end (its `wait()`'s return), for the backend's `start_forward`."""

    def __init__(self, backend: Any) -> None:
        self.ends: list[float] = []
        start_forward = backend.start_forward
        ends = self.ends

        class Timed:
            def __init__(self, step: Any) -> None:
                self._step = step

            def __getattr__(self, name: str) -> Any:
                return getattr(self._step, name)

            def wait(self) -> Any:
                out = self._step.wait()
                ends.append(time.perf_counter())
                return out

        self._backend, self._original = backend, start_forward
        backend.start_forward = lambda reqs, *a: Timed(start_forward(reqs, *a))

    def close(self) -> None:
        self._backend.start_forward = self._original


def one_run(backend: Any, chunk: int, prompt_len: int, decodes: int) -> dict[str, float]:
    """Decodes run, a prompt arrives: the ratios and times (see the module docstring)."""
    ends = Ends(backend)
    pm = PageManager(backend.info.num_pages, None, None)
    sched = Scheduler(AdaptivePolicy(), prefill_chunk=chunk)
    sched.bind(backend.forward, backend.copy_tokens, PS, pins=pm, start=backend.start_forward,
               feeds=bool(getattr(backend, "feeds", False)))
    vocab = backend.info.vocab_size
    gens: list[Generation] = []

    def submit(name: str, prompt: list[int], max_tokens: int) -> Any:
        table = InstancePages(name)
        n = -(-len(prompt) // PS)
        pages = pm.allocate(table, n)
        assert isinstance(pages, list)
        req = ForwardRequest(pages=list(pages), last_page_len=len(prompt) - (n - 1) * PS, tokens=prompt,
                             positions=list(range(len(prompt))),
                             outputs=[OutputSpec(index=len(prompt) - 1, sample=SamplerParams())], name=name, checked=True)
        gen = Generation(req, SamplerParams(), StopRules(max_tokens, frozenset(), (), 1 << 30), PS, pm, table,
                         lambda ids: "", None)
        gens.append(gen)
        return sched.submit(req, name, generation=gen)

    try:
        for k in range(decodes):
            submit(f"d{k}", [(k * 7 + i) % (vocab - 2) + 2 for i in range(16)], 1 << 20)
        while len(ends.ends) < 25:  # steady
            time.sleep(0.002)
        arrive = time.perf_counter()
        first = submit("prompt", [(i * 13) % (vocab - 2) + 2 for i in range(prompt_len)], 1)
        first.wait(600)
        done = time.perf_counter()
        time.sleep(0.05)
        for g in gens:
            g.cancel()
        threading.Event().wait(0.05)
    finally:
        sched.stop()
        ends.close()
    e = ends.ends
    steady = statistics.median(b - a for a, b in zip(e[5:24], e[6:25], strict=True))
    inside = [t for t in e if arrive <= t <= done]
    before = [t for t in e if t < arrive][-1]
    after = next((t for t in e if t > done), done)
    marks = [before, *inside, after]
    gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]
    return {"steady_tpot_ms": round(1000 * steady, 3), "max_gap_ratio": round(max(gaps) / steady, 2),
            "mean_gap_ratio": round(statistics.mean(gaps) / steady, 2), "ttft_ms": round(1000 * (done - arrive), 1),
            "chunks": sched.stats.prefill_chunks}


def main() -> None:
    opts = parse_args()
    results: dict[str, Any] = {"standin": {}, "meta": {"prompt": opts.prompt, "decodes": opts.decodes,
                                                       "step_ms": opts.step_ms, "token_us": opts.token_us}}
    need = -(-opts.prompt // PS) + opts.decodes * 64 + 64
    for chunk in opts.chunks:
        be = StandInBackend(page_size=PS, num_pages=need, delay_s=opts.step_ms / 1000, token_s=opts.token_us / 1e6)
        results["standin"][str(chunk)] = r = one_run(be, chunk, opts.prompt, opts.decodes)
        print("standin", chunk, json.dumps(r), flush=True)
    if opts.real:
        import torch

        from gpu_backend import load_backend

        be = load_backend(device="cpu", dtype=torch.float32, page_size=PS, num_pages=2048, progress=False)
        results["real_cpu"] = {"prompt": opts.real_prompt}
        for chunk in opts.real_chunks:
            results["real_cpu"][str(chunk)] = r = one_run(be, chunk, opts.real_prompt, opts.decodes)
            print("real_cpu", chunk, json.dumps(r), flush=True)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
