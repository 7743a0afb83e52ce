"""Service levels under long prompts: running decodes' TPOT while a long prompt prefills, chunked
(`--prefill-chunk`, host/batching/chunks.py) against unchunked (the baseline) in the same run.

Usage: python bench/qos.py --json OUT [--chunks 0 128 256 512 1024 auto] [--prompt 4096] [--decodes 16]
                           [--step-ms 10] [--token-us 20] [--real] [--real-prompt 1024] [--quick]
                           [--level-chunk auto] [--parts standin priority tenants]

On the scheduler alone (no instances): `--decodes` host-side loops run; once steady, one prompt of
`--prompt` tokens arrives (a host-side loop too). For each batch the decodes' tokens come out at the
batch's end, so a decode's gap between two tokens is the time between two batch ends. Reported per
chunk size (0 = unchunked; `auto`: sized per batch from the measured step cost,
host/batching/stepcost.py): the steady TPOT (median before the prompt), over the window from the
prompt's arrival to its first token the longest gap and the mean gap, both as ratios of the steady
TPOT (issue 52's targets: <= 3 and <= 1.5; also the mean against the steady TPOT after the prompt,
`steady_after_tpot_ms`: on a shared machine the load can change during a long window), and the prompt's time to first token (what chunking
costs it). Backends: the stand-in with a step of a fixed `--step-ms` plus `--token-us` per token
(new tokens of the batch), and with `--real` the default model on CPU (`--real-prompt` tokens: a
4,096-token prefill there takes minutes).

Priorities (`priority`): `--requests` prompts of `--req-prompt` tokens, each generating
`--req-tokens`, arrive at once (the stand-in; a batch holds `--batch-tokens`), half at priority -1
and half at +1, alternating; the mean TTFT and TPOT of each half, against the same run with every
priority 0 (the baseline). Tenants (`tenants`): tenant A floods `--flood` such requests at once, tenant
B sends one every `--interval` s (`--b-requests` of them); B's mean and max TTFT against an idle
host's (B alone, the baseline) and against the same flood with B counted as A (no turns between
tenants). The priority and tenant runs use `--level-chunk` (the host's default, `auto`), their
baselines too. `--parts`: which of these to run (`real` runs with `--real`). Writes JSON to --json.
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


def _chunk(value: str) -> int | str:
    return value if value == "auto" else int(value)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--chunks", type=_chunk, nargs="+", default=[0, 128, 256, 512, 1024, "auto"],
                    help="--prefill-chunk values (0 = unchunked, the baseline; auto)")
    ap.add_argument("--prompt", type=int, default=4096, help="the long prompt's tokens (stand-in)")
    ap.add_argument("--decodes", type=int, default=16, help="decodes running while it arrives")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the stand-in's fixed time per batch")
    ap.add_argument("--token-us", type=float, default=20.0, help="the stand-in's time per new token in a batch")
    ap.add_argument("--real", action="store_true", help="also the default model on CPU")
    ap.add_argument("--real-chunks", type=_chunk, nargs="+", default=[0, 16, 64, 256, "auto"],
                    help="chunks for --real")
    ap.add_argument("--real-prompt", type=int, default=1024, help="the long prompt's tokens with --real")
    ap.add_argument("--requests", type=int, default=64, help="priority run: requests arriving at once")
    ap.add_argument("--req-prompt", type=int, default=256, help="priority / tenant runs: each request's prompt")
    ap.add_argument("--req-tokens", type=int, default=16, help="priority / tenant runs: tokens each generates")
    ap.add_argument("--batch-tokens", type=int, default=2048, help="priority / tenant runs: max_batch_tokens")
    ap.add_argument("--flood", type=int, default=256, help="tenant run: tenant A's requests at once")
    ap.add_argument("--interval", type=float, default=1.0, help="tenant run: seconds between B's requests")
    ap.add_argument("--b-requests", type=int, default=5, help="tenant run: B's requests")
    ap.add_argument("--level-chunk", type=_chunk, default="auto",
                    help="--prefill-chunk of the priority and tenant runs (default auto, the host's)")
    ap.add_argument("--parts", nargs="*", choices=["standin", "priority", "tenants"],
                    default=["standin", "priority", "tenants"], help="which runs (--real adds the model's)")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): a 512-token prompt, 4 decodes")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(chunks=[0, 128, "auto"], prompt=512, decodes=4, step_ms=2.0, token_us=20.0,
                        real_chunks=[0, "auto"], real_prompt=128, requests=16, req_prompt=128, req_tokens=4,
                        batch_tokens=512, flood=32, interval=0.05, b_requests=3)
        opts = ap.parse_args()
    return opts


class Ends:
    """Each batch's end (its `wait()`'s return), for the backend's `start_forward`."""

    def __init__(self, backend: Any) -> None:
        self.ends: list[float] = []
        self.tokens: dict[float, int] = {}  # each batch's end -> its new tokens
        start_forward = backend.start_forward
        ends, sizes = self.ends, self.tokens

        class Timed:
            def __init__(self, step: Any, tokens: int) -> None:
                self._step, self._tokens = step, tokens

            def __getattr__(self, name: str) -> Any:
                return getattr(self._step, name)

            def wait(self) -> Any:
                out = self._step.wait()
                t = time.perf_counter()
                ends.append(t)
                sizes[t] = self._tokens
                return out

        self._backend, self._original = backend, start_forward
        backend.start_forward = lambda reqs, *a: Timed(start_forward(reqs, *a), sum(len(r.tokens) for r in reqs))

    def close(self) -> None:
        self._backend.start_forward = self._original


def one_run(backend: Any, chunk: int | str, prompt_len: int, decodes: int) -> dict[str, Any]:
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
        n_done = len(ends.ends)
        while len(ends.ends) < n_done + 21:  # steady again: the TPOT after (the machine's load may drift)
            time.sleep(0.002)
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
    later = [t for t in e if t > after][:20]
    steady_after = statistics.median(b - a for a, b in zip(later, later[1:], strict=False)) if len(later) > 2 else steady
    return {"steady_tpot_ms": round(1000 * steady, 3), "steady_after_tpot_ms": round(1000 * steady_after, 3),
            "max_gap_ratio": round(max(gaps) / steady, 2),
            "mean_gap_ratio_vs_after": round(statistics.mean(gaps) / steady_after, 2),
            "mean_gap_ratio": round(statistics.mean(gaps) / steady, 2), "ttft_ms": round(1000 * (done - arrive), 1),
            "worst_gaps": [[round(g / steady, 2), ends.tokens.get(t, 0)] for g, t in sorted(
                zip(gaps, marks[1:], strict=True), reverse=True)[:3]],  # (ratio, the batch's new tokens)
            "chunks": sched.stats.prefill_chunks, "prefill_budget": sched.stats.prefill_budget,
            "step_fixed_ms": sched.stats.step_fixed_ms, "step_token_us": sched.stats.step_token_us}


class Requests:
    """Host-side loops on one scheduler, each with its owner's service level; times their first
    token and their end."""

    def __init__(self, backend: Any, batch_tokens: int, chunk: int | str = 0) -> None:
        self.pm = PageManager(backend.info.num_pages, None, None)
        self.sched = Scheduler(AdaptivePolicy(), max_batch_tokens=batch_tokens, prefill_chunk=chunk)
        self.sched.bind(backend.forward, backend.copy_tokens, PS, pins=self.pm, start=backend.start_forward,
                        feeds=bool(getattr(backend, "feeds", False)))
        self.vocab = backend.info.vocab_size
        self.n = 0

    def submit(self, prompt_len: int, tokens: int, priority: int = 0, tenant: str = "t") -> dict[str, Any]:
        """One request; returns its record: arrive, first (first token), done, future."""
        self.n += 1
        name = f"r{self.n}"
        self.sched.set_class(name, priority, tenant)
        table = InstancePages(name)
        npg = -(-prompt_len // PS)
        pages = self.pm.allocate(table, npg)  # (the loop allocates the pages its tokens need)
        assert isinstance(pages, list)
        prompt = [(self.n * 7 + i) % (self.vocab - 2) + 2 for i in range(prompt_len)]
        req = ForwardRequest(pages=list(pages), last_page_len=prompt_len - (npg - 1) * PS, tokens=prompt,
                             positions=list(range(prompt_len)),
                             outputs=[OutputSpec(index=prompt_len - 1, sample=SamplerParams())], name=name, checked=True)
        rec: dict[str, Any] = {"arrive": time.perf_counter(), "first": None, "priority": priority}

        def sent(_text: str) -> None:
            if rec["first"] is None:
                rec["first"] = time.perf_counter()

        gen = Generation(req, SamplerParams(), StopRules(tokens, frozenset(), (), 1 << 30), PS, self.pm, table,
                         lambda ids: "x", sent)
        fut = self.sched.submit(req, name, generation=gen)
        fut.add_done_callback(lambda _f: rec.__setitem__("done", time.perf_counter()))
        rec["future"] = fut
        return rec

    def close(self) -> None:
        self.sched.stop()


def _ttft_tpot(recs: list[dict[str, Any]], tokens: int) -> dict[str, float]:
    ttft = [r["first"] - r["arrive"] for r in recs]
    tpot = [(r["done"] - r["first"]) / max(tokens - 1, 1) for r in recs]
    return {"ttft_ms": round(1000 * statistics.mean(ttft), 1), "ttft_max_ms": round(1000 * max(ttft), 1),
            "tpot_ms": round(1000 * statistics.mean(tpot), 2)}


def priority_run(opts: argparse.Namespace, prioritized: bool) -> dict[str, Any]:
    """`--requests` at once, alternating high / low (or all 0): each half's TTFT and TPOT."""
    need = opts.requests * (-(-(opts.req_prompt + opts.req_tokens) // PS) + 1) + 64
    be = StandInBackend(page_size=PS, num_pages=need, delay_s=opts.step_ms / 1000, token_s=opts.token_us / 1e6)
    rq = Requests(be, opts.batch_tokens, opts.level_chunk)
    try:
        recs = [rq.submit(opts.req_prompt, opts.req_tokens, (-1 if k % 2 == 0 else 1) if prioritized else 0)
                for k in range(opts.requests)]
        for r in recs:
            r["future"].wait(600)
        aged = rq.sched.levels.aged
    finally:
        rq.close()
    high, low = recs[0::2], recs[1::2]
    return {"high": _ttft_tpot(high, opts.req_tokens), "low": _ttft_tpot(low, opts.req_tokens), "aged": aged}


def tenant_run(opts: argparse.Namespace, flood: int, b_tenant: str) -> dict[str, Any]:
    """Tenant A floods `flood` requests; B sends one every `--interval` s: B's TTFT."""
    need = (flood + opts.b_requests) * (-(-(opts.req_prompt + opts.req_tokens) // PS) + 1) + 64
    be = StandInBackend(page_size=PS, num_pages=need, delay_s=opts.step_ms / 1000, token_s=opts.token_us / 1e6)
    rq = Requests(be, opts.batch_tokens, opts.level_chunk)
    try:
        flooded = [rq.submit(opts.req_prompt, opts.req_tokens, 0, "A") for _ in range(flood)]
        bs = []
        for _ in range(opts.b_requests):
            time.sleep(opts.interval if flood else 0.0)
            bs.append(rq.submit(opts.req_prompt, opts.req_tokens, 0, b_tenant))
            if not flood:
                bs[-1]["future"].wait(600)
        for r in flooded + bs:
            r["future"].wait(600)
    finally:
        rq.close()
    ttft = [r["first"] - r["arrive"] for r in bs]
    out = {"b_ttft_ms": round(1000 * statistics.mean(ttft), 1), "b_ttft_max_ms": round(1000 * max(ttft), 1),
           "b_ttft_all_ms": [round(1000 * t, 1) for t in ttft]}
    if flooded:  # how long A's flood took to prefill and to finish, and how many of B's came meanwhile
        t0 = flooded[0]["arrive"]
        last_first = max(r["first"] for r in flooded)
        out.update({"a_prefilled_s": round(last_first - t0, 3), "a_done_s": round(max(r["done"] for r in flooded) - t0, 3),
                    "b_during_flood": sum(1 for r in bs if r["arrive"] < last_first)})
    return out


def main() -> None:
    opts = parse_args()
    results: dict[str, Any] = {"standin": {}, "meta": {"prompt": opts.prompt, "decodes": opts.decodes,
                                                       "step_ms": opts.step_ms, "token_us": opts.token_us}}
    need = -(-opts.prompt // PS) + opts.decodes * 64 + 64
    for chunk in opts.chunks if "standin" in opts.parts else []:
        be = StandInBackend(page_size=PS, num_pages=need, delay_s=opts.step_ms / 1000, token_s=opts.token_us / 1e6)
        results["standin"][str(chunk)] = r = one_run(be, chunk, opts.prompt, opts.decodes)
        print("standin", chunk, json.dumps(r), flush=True)
    if "priority" in opts.parts:
        pr = {"baseline": priority_run(opts, False), "prioritized": priority_run(opts, True)}
        pr["meta"] = {"requests": opts.requests, "prompt": opts.req_prompt, "tokens": opts.req_tokens,
                      "batch_tokens": opts.batch_tokens, "prefill_chunk": opts.level_chunk}
        results["priority"] = pr
        print("priority", json.dumps(pr), flush=True)
    if "tenants" in opts.parts:
        idle = tenant_run(opts, 0, "B")
        turns = tenant_run(opts, opts.flood, "B")
        fifo = tenant_run(opts, opts.flood, "A")
        results["tenants"] = {"idle": idle, "turns": turns, "one_tenant": fifo,
                              "b_ttft_vs_idle": round(turns["b_ttft_ms"] / idle["b_ttft_ms"], 2),
                              "b_ttft_max_vs_idle": round(turns["b_ttft_max_ms"] / idle["b_ttft_ms"], 2),
                              "meta": {"flood": opts.flood, "interval_s": opts.interval, "b_requests": opts.b_requests,
                                       "prefill_chunk": opts.level_chunk}}
        print("tenants", json.dumps(results["tenants"]), flush=True)
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
