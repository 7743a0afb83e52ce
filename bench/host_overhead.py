"""Host overhead: host-call cost, programmability tax, scaling with instances, launch time.

Usage: python bench/host_overhead.py --json OUT [--max-tokens 32] [--reps 7] [--quick]

`--quick` (CI: the script still runs end to end): 8 tokens, one repetition of each tax, fewer
host calls, 1 and 4 instances.

- call_us.empty: an empty import round trip (runtime.elapsed-ms) timed inside the guest.
- call_us.forward: forward.run of a 1-token pass (submit + batch + wait) timed inside the guest;
  call_us.forward_host_overhead: the same minus the backend's own time for those batches;
  call_us.decode / decode_host_overhead: the same pass through forward.decode-step (what the
  SDK's decode loop uses).
- tax: time per output token (TPOT: (end - first token) / (tokens - 1), mean over requests) of
  text_completion through the host / the same for the backend's own greedy loop
  (Backend.generate_batch, run on the host's backend thread) on the same prompts, 1 and 16 at
  once (same tokens: both greedy). The host's end is the instance's end event, so finishing the
  instance counts. Also reported: tax_e2e (whole wall time incl. launch and prefill, host /
  direct), tax_itl (ratio of the median inter-token latencies, pooled over the repetitions: a
  noise-robust estimate of the per-step tax), tax_step (the median start-to-start period of the
  host's decode batches / the same of the backend's own loop, pooled over the repetitions: the
  host's share of each step; both sides launch a decode step before the one it reads from is
  waited for) and tax_no_gate / tax_no_gate_step (the run gate off,
  host/gate.py, same run). Each tax is the median over --reps repetitions that alternate which
  side runs first.
- scaling_tok_s: aggregate generated tokens/s with 1, 4, 16, 64 concurrent text_completion instances.
- launch_ms: median time from Host.launch to the instance's first forward submit (cached program).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpu_backend.backend import TorchBackend, TorchStep
from gpu_backend.types import SamplerParams
from host import Host, HostConfig
from host.cli.build import build_inferlet, resolve_inferlet

ROOT = Path(__file__).resolve().parent.parent

TOPICS = ["the ocean", "mountains", "computers", "music", "cooking", "trains", "the moon", "gardens"]


def prompts(n: int) -> list[str]:
    return [f"Write a long story about {TOPICS[i % len(TOPICS)]} number {i}." for i in range(n)]


class Timeline:
    """Per request: when its first token came out and when it ended, and how many tokens it had.

    Host side: the completion of an instance's first forward (text_completion prefills and
    samples the first token in one pass) and its end event. Direct side: the completion of the
    first and the last forward that carried the sequence. TPOT = (end - first) / (tokens - 1).
    """

    def __init__(self) -> None:
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}  # completion of the request's last forward
        self.end: dict[str, float] = {}  # the request's end event, where there is one
        self.count: dict[str, int] = {}
        self.itl: list[float] = []  # inter-token latencies, all requests
        self.batches: list[tuple[float, float]] = []  # host side: (start, end) of each backend call

    def periods(self) -> list[float]:
        """Start-to-start periods of consecutive batches after the first (the prefill): the decode
        steps. A fed batch is launched before the one before it is waited for, so a batch's own
        start-to-wait time is not its step; the period between launches is, on either side."""
        starts = sorted(b[0] for b in self.batches)
        return [y - x for x, y in zip(starts[1:], starts[2:], strict=False)]

    def forward_done(self, keys: list[str]) -> None:
        now = time.perf_counter()
        for k in keys:
            if k in self.last:
                self.itl.append(now - self.last[k])
            self.first.setdefault(k, now)
            self.count[k] = self.count.get(k, 0) + 1
            self.last[k] = now

    def tpot_s(self) -> float:
        """Mean time per output token over the requests (after the first token)."""
        vals = [(self.end.get(k, self.last[k]) - self.first[k]) / (self.count[k] - 1)
                for k in self.first if self.count[k] > 1]
        if not vals:
            raise RuntimeError("no request produced more than one token: raise --max-tokens")
        return statistics.fmean(vals)


@contextlib.contextmanager
def clocked(owner: Any, attr: str, tl: Timeline) -> Iterator[None]:
    """Time every batch started through `owner.attr` from now on (the host's scheduler's `_start`,
    bound to the backend's `start_forward` when the host was made; the backend's own
    `start_forward`, which `generate_batch` calls): the call notes the batch's start, and the first
    `wait()` on it its end and each of its requests' token (`Timeline.forward_done`, keyed by the
    request's name). Both sides launch a decode step before the one it reads its token from is
    waited for. `TorchStep.wait` is patched on the class: a step is also the `Feed` source of the
    next, so it cannot be wrapped."""
    start_forward, wait = getattr(owner, attr), TorchStep.wait
    had_own = attr in vars(owner)
    started: dict[int, tuple[float, list[str]]] = {}

    def spy_start(reqs: Any, *args: Any) -> TorchStep:
        t0 = time.perf_counter()
        step = start_forward(reqs, *args)
        started[id(step)] = (t0, [r.name for r in reqs])
        return step

    def spy_wait(step: TorchStep) -> Any:
        out = wait(step)
        entry = started.pop(id(step), None)
        if entry is not None:
            tl.batches.append((entry[0], time.perf_counter()))
            tl.forward_done(entry[1])
        return out

    setattr(owner, attr, spy_start)
    TorchStep.wait = spy_wait  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had_own:
            setattr(owner, attr, start_forward)
        else:
            delattr(owner, attr)  # back to the class's method
        TorchStep.wait = wait  # type: ignore[method-assign]


def run_host(host: Host, program: str, texts: list[str], max_tokens: int) -> tuple[float, Timeline, list[str]]:
    import queue

    q: queue.Queue = queue.Queue()
    tl = Timeline()

    def on_event(ev) -> None:  # type: ignore[no-untyped-def]
        if ev.event in ("completed", "exception", "aborted", "out_of_resources"):
            tl.end[f"instance {ev.instance_id[:8]}"] = time.perf_counter()  # the request's end: its result is out
        q.put(ev)

    with clocked(host.scheduler, "_start", tl):  # the host's requests are named after their instance (Instance.label)
        t0 = time.perf_counter()
        ids = [host.launch(program, ["--prompt", p, "--max-tokens", str(max_tokens)], on_event) for p in texts]
        ends = {}
        while len(ends) < len(ids):
            ev = q.get(timeout=600)
            if ev.event in ("completed", "exception", "aborted", "out_of_resources"):
                if ev.event != "completed":
                    raise RuntimeError(f"instance failed: {ev.message}")
                ends[ev.instance_id] = ev.message
        wall = time.perf_counter() - t0
    return wall, tl, [ends[i] for i in ids]


def run_direct(backend: TorchBackend, texts: list[str], max_tokens: int) -> tuple[float, Timeline, int]:
    tok = backend.tokenizer
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True))
           for p in texts]
    tl = Timeline()
    with clocked(backend, "start_forward", tl):  # its requests are named "generate[i]"
        t0 = time.perf_counter()
        outs = backend.generate_batch(ids, max_tokens, SamplerParams())
        wall = time.perf_counter() - t0
    return wall, tl, sum(len(o) for o in outs)


def guest_call(host: Host, program: str, args: list[str]) -> float:
    import queue

    q: queue.Queue = queue.Queue()
    host.launch(program, args, q.put)
    while True:
        ev = q.get(timeout=120)
        if ev.event == "completed":
            return float(ev.message)
        if ev.event != "message":
            raise RuntimeError(ev.message)


def launch_ms(host: Host, program: str, reps: int = 15) -> float:
    sched = host.scheduler
    orig = sched.submit
    first: dict[str, float] = {}

    def spy(req, owner):
        first.setdefault(owner, time.perf_counter())
        return orig(req, owner)

    sched.submit = spy  # type: ignore[method-assign]
    times = []
    try:
        for _ in range(reps):
            t0 = time.perf_counter()
            iid = host.launch(program, ["forward", "1"])
            host.wait(iid, 60)
            times.append(1000 * (first[iid] - t0))
    finally:
        sched.submit = orig  # type: ignore[method-assign]
    return statistics.median(times)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write results here")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="default: fp32 on CPU")
    ap.add_argument("--reps", type=int, default=7, help="repetitions of each tax measurement (median)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 8 tokens, 1 repetition, fewer calls, 1 and 4 instances")
    opts = ap.parse_args()
    if opts.quick:
        opts.max_tokens, opts.reps = 8, 1
    if opts.max_tokens < 3 or opts.reps < 1:
        ap.error("--max-tokens must be at least 3 (a time per output token needs two after the first) "
                 "and --reps at least 1")
    return opts


def direct(host: Host, texts: list[str], max_tokens: int) -> tuple[float, Timeline, int]:
    """`run_direct` on the host's scheduler thread, where the model was loaded and its forwards run
    (torch on CPU is ~15-20% slower on a thread other than the loader's)."""
    backend = host.backend
    return host.scheduler.call(lambda: run_direct(backend, texts, max_tokens))


def measure_calls(host: Host, calls: str, res: dict, quick: bool = False) -> None:
    """call_us (empty import, forward.run and decode-step, with their host overhead) and launch_ms."""
    reps, calls_n = (1, 20) if quick else (3, 200)
    res["call_us"]["empty"] = statistics.median(guest_call(host, calls, ["empty", str(10 * calls_n)])
                                                for _ in range(reps))
    st = host.scheduler.stats
    for mode in ("forward", "decode"):
        per_call, over = [], []
        for _ in range(reps):
            b0, s0 = st.batches, st.backend_s
            us = guest_call(host, calls, [mode, str(calls_n)])
            per_call.append(us)
            over.append(us - 1e6 * (st.backend_s - s0) / (st.batches - b0))  # minus the backend's own time
        res["call_us"][mode] = statistics.median(per_call)
        res["call_us"][f"{mode}_host_overhead"] = statistics.median(over)
    res["launch_ms"] = launch_ms(host, calls, 3 if quick else 15)


def tax_runs(host: Host, tc: str, n: int, opts: argparse.Namespace) -> tuple[list[float], ...]:
    """--reps host/direct runs of n prompts: (TPOT ratios, end-to-end ratios, host ITLs, direct ITLs,
    host step ratios)."""
    ratios, e2e, itl_host, itl_direct, steps, steps_direct = [], [], [], [], [], []
    for rep in range(opts.reps):
        # alternate which side goes first, so a slow drift of the machine cancels out
        if rep % 2 == 0:
            t_direct, tl_direct, _ = direct(host, prompts(n), opts.max_tokens)
            t_host, tl_host, _ = run_host(host, tc, prompts(n), opts.max_tokens)
        else:
            t_host, tl_host, _ = run_host(host, tc, prompts(n), opts.max_tokens)
            t_direct, tl_direct, _ = direct(host, prompts(n), opts.max_tokens)
        ratios.append(tl_host.tpot_s() / tl_direct.tpot_s())
        e2e.append(t_host / t_direct)
        itl_host += tl_host.itl
        itl_direct += tl_direct.itl
        steps += tl_host.periods()
        steps_direct += tl_direct.periods()
    return ratios, e2e, itl_host, itl_direct, steps, steps_direct


def measure_tax(host: Host, tc: str, opts: argparse.Namespace, res: dict) -> None:
    """tax, tax_e2e, tax_itl, tax_step at 1 and 16 at once, then tax_no_gate(_step) with the run gate off."""
    run_host(host, tc, prompts(2), 4)  # warm-up
    for key, gate in (("tax", True), ("tax_no_gate", False)):
        host.gate.enabled = gate
        for n in (1, 4) if opts.quick else (1, 16):
            ratios, e2e, itl_host, itl_direct, steps, steps_direct = tax_runs(host, tc, n, opts)
            step = statistics.median(steps) / statistics.median(steps_direct)
            itl = statistics.median(itl_host) / statistics.median(itl_direct)
            res.setdefault(key, {})[str(n)] = statistics.median(ratios)
            if gate:
                res.setdefault("tax_e2e", {})[str(n)] = statistics.median(e2e)
                res.setdefault("tax_itl", {})[str(n)] = itl
            res.setdefault(f"{key}_step", {})[str(n)] = step
            print(f"{key} at {n}: TPOT ratio {statistics.median(ratios):.3f} (runs {', '.join(f'{r:.3f}' for r in ratios)});"
                  f" end-to-end {statistics.median(e2e):.3f}; median inter-token latency ratio {itl:.3f};"
                  f" median decode step period host / direct {step:.3f}", flush=True)
    host.gate.enabled = True


def measure_scaling(host: Host, tc: str, opts: argparse.Namespace, res: dict) -> None:
    for n in (1, 4) if opts.quick else (1, 4, 16, 64):
        _, _, tokens = direct(host, prompts(n), opts.max_tokens)  # same greedy outputs: same token count
        t_host, _, _ = run_host(host, tc, prompts(n), opts.max_tokens)
        res["scaling_tok_s"][str(n)] = tokens / t_host
        print(f"scaling {n}: {tokens / t_host:.1f} tok/s", flush=True)


def write_results(path: Path, res: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))


def print_report(res: dict) -> None:
    print("\n| metric | value |\n|---|---|")
    print(f"| empty import call | {res['call_us']['empty']:.1f} us |")
    print(f"| forward submit+wait (1 token) | {res['call_us']['forward']:.1f} us |")
    print(f"| ... of which host overhead (not backend) | {res['call_us']['forward_host_overhead']:.1f} us |")
    print(f"| forward.decode-step (1 token) | {res['call_us']['decode']:.1f} us |")
    print(f"| ... of which host overhead (not backend) | {res['call_us']['decode_host_overhead']:.1f} us |")
    print(f"| launch to first forward | {res['launch_ms']:.1f} ms |")
    for k, v in res["tax"].items():
        print(f"| tax at {k} concurrent (TPOT host/direct) | {v:.3f} |")
        print(f"| ... run gate off | {res['tax_no_gate'][k]:.3f} |")
        print(f"| ... end to end incl. launch + prefill | {res['tax_e2e'][k]:.3f} |")
        print(f"| ... median inter-token latency (robust to noise) | {res['tax_itl'][k]:.3f} |")
        print(f"| ... median decode step period, host / the backend's own loop, gate on / off | {res['tax_step'][k]:.3f} / "
              f"{res['tax_no_gate_step'][k]:.3f} |")
    for k, v in res["scaling_tok_s"].items():
        print(f"| aggregate tok/s at {k} instances | {v:.1f} |")
    s1, top = res["scaling_tok_s"]["1"], max(res["scaling_tok_s"], key=int)
    print(f"| scaling {top} vs 1 | {res['scaling_tok_s'][top] / s1:.2f}x |")


def main() -> None:
    opts = parse_args()
    # The host loads the model on its scheduler thread, where all its forwards run; the direct
    # baseline runs there too (see `direct`).
    host = Host(HostConfig(device=opts.device, dtype=opts.dtype, num_pages=4096))
    backend = host.backend
    tc = host.compile(resolve_inferlet("text_completion").read_bytes())
    calls = host.compile(build_inferlet(ROOT / "bench" / "inferlets" / "hostcalls").read_bytes())
    res: dict = {"call_us": {}, "tax": {}, "scaling_tok_s": {}, "device": str(backend.info.device),
                 "dtype": backend.info.dtype, "run_slots": host.gate.slots, "max_tokens": opts.max_tokens}
    measure_calls(host, calls, res, opts.quick)
    measure_tax(host, tc, opts, res)
    measure_scaling(host, tc, opts, res)
    res["scheduler"] = host.scheduler.stats.as_dict()
    host.shutdown()
    write_results(opts.json, res)
    print_report(res)


if __name__ == "__main__":
    main()
