"""Can the host keep up with a GPU? The real host in front of a stand-in backend that sleeps per batch.

Usage: python bench/host_scale.py --json OUT [--step-ms 10 2] [--instances 1 16 64 256] [--tokens 64]
                                  [--engine inproc|process] [--workloads app step]
                                  [--variants default reap_first] [--rounds R] [--no-cold]
                                  [--sequence 64 256 64 256] [--quick]
       python bench/host_scale.py --back-to-back --json OUT [--step-ms 10 2] [--instances 64 256]
                                  [--backends forward overlap] [--variants default idle_only]

The stand-in (gpu_backend/standin.py) sleeps `step-ms` per batch with the GIL released, as a GPU
step does, and returns deterministic tokens (next = last + 1), so every output is checked. Two
workloads, N instances launched at once:
- `app`: the standard `text_completion` inferlet, greedy, `--tokens` new tokens;
- `step`: a guest that drives every token itself with `decode-step` (bench/inferlets/stepper).
The ideal is the backend alone: one prefill step and `tokens` decode steps for all N together, so
ideal_tok_s = N * tokens / ((tokens + 1) * step) and efficiency = tok_s / ideal_tok_s; tok_s counts
the whole wall time from the first launch to the last instance's end. mean_batch = forwards per
backend call. rss_mb_per_instance: resident memory added by 256 live `step` instances.
Each workload runs on a host of its own (a host that has just served 256-instance bursts of
`app` ran `step` ~7% slower here: a confound, not the workload's cost). Each entry is measured
twice in the same run, after an unmeasured burst of the same size, each
time as the median (by efficiency) of `--bursts` bursts (3; this 2-core VM varies by +-5% from one
burst to the next): as the host runs by default (`tok_s`, `efficiency`, ...: the warm pool, host/wasm/warm.py, has refilled
to the N instances the program just had running, so the launches skip the instances' start-up),
and with `cold_*` keys: the pool off (`--warm-auto 0`), every instance started from scratch.
`--variants` (below) compares host settings settled too, each workload and variant on hosts of
its own, reported as `WORKLOAD@VARIANT`; `--rounds R` measures them all R times in turn (the entry:
the round with the median efficiency, and `efficiency_rounds`); `--no-cold` skips the cold bursts.
`--engine process` runs the same stand-in in an engine process (gpu_backend/engine/client.py, fed over
pyzmq + msgpack, as `pie-serve --engine process` does) instead of on the host's scheduler thread;
bench/engine.py compares the two in one run.

`--back-to-back` measures bursts the way traffic arrives instead (`app` only): for each step,
backend and N, a fresh host (started as `pie-serve` starts one: `Host.warm_start` readies the
standard `text_completion`'s pool before it serves) takes a first burst of N (`fresh`), and then
`--bursts` more bursts, each launched the moment the previous one's last instance has ended
(`back_to_back`: the median, and `back_to_back_all`); `warm_ready`: the parked instances a burst's
launches found. Backends: `forward`, one that only has
`forward` (`HostConfig.run_ahead=False`, as a backend without `start_forward`), and `overlap`
(the stand-in's `start_forward`). Variants, each on hosts of its own, in one run for a same-hour
comparison: `default` (the host as it runs by default), `idle_only` (the warm pool and the reaper
work only while the host is idle, and a fresh host warms nothing: the rule before
`HostConfig.warm_yield`), `warm_start_idle_only` (the fresh host's pool readied, refills only
while idle), `no_start_wait` (refills and frees do not wait while launched instances start:
host/wasm/instance.py's `Starts`), `prime_once` (`Host.warm_start` primes one slot per parked
instance instead of two), `on_demand` (`HostConfig.instance_pool=False`: wasmtime's on-demand allocator)
`wasmtime_values` (host calls' lists and records converted element by element, as wasmtime-py
does, instead of host/api/fastcall.py's paths) and `reap_first` (the warm pool waits for every
finished store to be freed before it refills, even into slots used before that are free), and
`workers0` / `workers2` / `workers2_switch05` (the guests in the host's process, or in 2 worker
processes, the last with a 0.5 ms GIL switch interval; `default` runs `HostConfig.workers`' default, auto).
Every burst also reports the process's CPU, kernel CPU and page faults per instance
(`cpu_ms_per_instance`, `sys_ms_per_instance`, `faults_per_instance`; with workers also theirs:
`workers_cpu_ms_per_instance`, `workers_faults_per_instance`), the launching thread's time
for its N launches (`launch_ms`: a launch that finds no parked instance makes one cold, its thread
started by host/wasm/starter.py's thread), and back to
back where the time beyond the backend's goes: `ramp_ms` (from the first launch to the first
backend call with 90% of the N in it), `period_ms` (the median time from a backend call's start to
the next's, both holding all N: the step plus the host's work per step that the backend waits
for) and `tail_ms` (from the end of the last backend call to the last instance's end event).

The default run also measures `sequence` (`--sequence`, 64 256 64 256; `--sequence` with no sizes
skips it; `--workloads` with none skips the settled bursts; each of `--variants`, `--rounds` times
in turn): a user's own backend that has only `forward` (`ForwardOnly`: the host wraps it with
`started`, no run-ahead, no feed) in front of a fresh host (no `warm_start`: the embedding API),
the standard `text_completion` (`--raw`) launched in bursts of those sizes, each the moment the
one before has ended; `efficiency` per burst, and `by_size`: the median of each size's bursts. A
burst right after a bigger one meets what that one left (the pool refilling, the stores being
freed): the regression of issue 56 showed there first.

`--quick` (CI: every path runs, in seconds): 10 ms step, 1 and 16 instances, 16 tokens, one burst,
no cold bursts, a sequence of 16 64 16, 32 live instances for the memory figure.
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import resource
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from common import ROOT, BatchLog, Run, compile_inferlet, settle

import host.wasm.warm as warm_module
from gpu_backend.engine.client import EngineSpec, start_engines
from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.api import fastcall
from host.cli.build import resolve_inferlet
from host.wasm.engine import WasmEngine
from host.wasm.starts import Starts

PROMPT = "Write a story about a lighthouse."
BACKENDS = {"forward": {"run_ahead": False}, "overlap": {"run_ahead": True}, "forward_only": {"forward_only": True}}
# Host settings for --back-to-back; `warm_start`: standard inferlets whose pools a fresh host readies.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {"warm_start": ("text_completion",)},
    # the host before issue 40's second round, one change at a time (module settings patched
    # for the variant's host only): refills and frees go on while launched instances start ...
    "no_start_wait": {"warm_start": ("text_completion",), "patch": {"starts_wait": False}},
    # ... and warm_start primes one slot per parked instance, not two
    "prime_once": {"warm_start": ("text_completion",), "patch": {"prime_factor": 1}},
    # no pooling allocator: memory mapped at each instantiation and unmapped at the end
    "on_demand": {"warm_start": ("text_completion",), "config": {"instance_pool": False}},
    "idle_only": {"warm_start": (), "config": {"warm_yield": False}},
    # instance threads running at once (HostConfig.run_slots, 2 by default; host/batching/gate.py)
    "slots1": {"warm_start": ("text_completion",), "config": {"run_slots": 1}},
    "slots4": {"warm_start": ("text_completion",), "config": {"run_slots": 4}},
    "no_gate": {"warm_start": ("text_completion",), "config": {"run_gate": False}},
    # a burst's first batch waits up to 50 ms after the last launch for the launched instances' first
    # forwards (HostConfig.launch_grace_ms, 2 by default)
    "grace50": {"warm_start": ("text_completion",), "config": {"launch_grace_ms": 50.0}},
    "warm_start_idle_only": {"warm_start": ("text_completion",), "config": {"warm_yield": False}},
    # host calls' lists and records converted element by element, as wasmtime-py does (host/api/fastcall.py)
    "wasmtime_values": {"warm_start": ("text_completion",), "patch": {"fast_values": False}},
    # refills wait until the reaper has freed every finished store, even while slots used before are
    # free (the rule before issue 40's fourth round: WasmEngine.reaping)
    "reap_first": {"warm_start": ("text_completion",), "patch": {"reuse_slots": False}},
    # the GIL switch interval at 0.5 ms whatever the backend (the default before issue 56; now only on CUDA)
    "switch05": {"warm_start": ("text_completion",), "config": {"switch_interval_ms": 0.5}},
    # the guests in the host's process, or in 2 worker processes (HostConfig.workers; `default` is
    # its default, "auto")
    "workers0": {"warm_start": ("text_completion",), "config": {"workers": 0}},
    "workers2": {"warm_start": ("text_completion",), "config": {"workers": 2}},
    # and with the GIL switch interval at 0.5 ms (tried for the stepping guest: no change, bench/HISTORY.md)
    "workers2_switch05": {"warm_start": ("text_completion",), "config": {"workers": 2, "switch_interval_ms": 0.5}},
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--step-ms", type=float, nargs="+", default=[10.0, 2.0], help="backend time per batch")
    ap.add_argument("--instances", type=int, nargs="+", default=[1, 16, 64, 256], help="concurrent instances")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per instance")
    ap.add_argument("--bursts", type=int, default=3, help="measured bursts per entry (the median is reported)")
    ap.add_argument("--engine", choices=("inproc", "process"), default="inproc",
                    help="the stand-in on the host's scheduler thread, or in an engine process")
    ap.add_argument("--no-warm-yield", action="store_true",
                    help="HostConfig.warm_yield off: the warm pool refills and the reaper frees only when the host is idle")
    ap.add_argument("--compare-feed", action="store_true",
                    help="also `app_no_feed`: text_completion with a stand-in that takes no Feed (the baseline of fed batches)")
    ap.add_argument("--back-to-back", action="store_true",
                    help="bursts as traffic arrives: a fresh host's first burst, then bursts one right after another")
    ap.add_argument("--backends", nargs="+", choices=tuple(BACKENDS), default=list(BACKENDS),
                    help="with --back-to-back: a backend with only `forward`, and one that overlaps")
    ap.add_argument("--inferlets", type=Path, default=None, metavar="DIR",
                    help="with --back-to-back: take NAME.wasm from DIR instead of building the standard inferlets "
                         "(the GPU kit's folder has text_completion.wasm.gz)")
    ap.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=["default"],
                    help="host settings to compare in the same run, each on hosts of its own (settled: "
                         "reported as WORKLOAD@VARIANT; a variant's warm_start applies to --back-to-back only)")
    ap.add_argument("--workloads", nargs="*", choices=("app", "step"), default=["app", "step"],
                    help="settled: the workloads to measure (none: skip the settled bursts)")
    ap.add_argument("--no-cold", action="store_true", help="settled: skip the cold-start bursts (no cold_* keys)")
    ap.add_argument("--sequence", type=int, nargs="*", default=[64, 256, 64, 256], metavar="N",
                    help="settled run: bursts of these sizes back to back behind a forward-only backend "
                         "(`sequence`); none: skip it")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 10 ms, 1 and 16 instances, 16 tokens, one burst, no cold "
                         "bursts, a sequence of 16 64 16")
    ap.add_argument("--rounds", type=int, default=1,
                    help="settled: measure every workload and variant this many times, alternated; each entry "
                         "is the round with the median efficiency, `efficiency_rounds` lists them all")
    opts = ap.parse_args()
    if opts.quick:
        opts.step_ms, opts.instances, opts.tokens, opts.bursts, opts.no_cold = [10.0], [1, 16], 16, 1, True
        opts.sequence = [16, 64, 16] if opts.sequence else []
    if opts.rounds < 1 or opts.bursts < 1 or min(opts.instances + opts.sequence, default=1) < 1 or opts.tokens < 1:
        ap.error("--rounds, --bursts, --instances, --sequence and --tokens must be at least 1")
    return opts


class ForwardOnly:
    """A user's own backend with only `forward` (and `copy_tokens`): no `start_forward`, no `feeds`,
    so the host runs it through `gpu_backend.types.started`, one batch at a time."""

    def __init__(self, inner: StandInBackend) -> None:
        self._inner = inner
        self.info, self.tokenizer = inner.info, inner.tokenizer

    def forward(self, reqs: Any) -> Any:
        return self._inner.forward(reqs)

    def copy_tokens(self, *args: Any) -> Any:
        return self._inner.copy_tokens(*args)


def make_host(engine: str, step_s: float, feed: bool = True, log: list[BatchLog] | None = None,
              forward_only: bool = False, **config: Any) -> Host:
    """The host (HostConfig `config`) in front of the stand-in sleeping `step_s` per batch, in-process
    or in an engine process. `feed` False: the stand-in takes no `Feed`, so the scheduler waits for
    each batch of loops before it launches the next (the host before fed batches). `log`: a
    `BatchLog` of the in-process stand-in's calls is appended to it. `forward_only`: the stand-in
    behind `ForwardOnly`."""
    if engine == "process":
        spec = EngineSpec(standin=True, page_size=16, num_pages=16384, standin_delay_s=step_s)
        return Host(HostConfig(engine="process", **config), engines=start_engines(spec))
    backend = StandInBackend(page_size=16, num_pages=16384, delay_s=step_s)
    backend.feeds = feed
    if log is not None:
        log.append(BatchLog(backend))
    return Host(HostConfig(**config), backend=ForwardOnly(backend) if forward_only else backend)


def expected_text(host: Host, tokens: int, raw: bool = False) -> str:
    """text_completion's output on the stand-in: the tokens after the chat prompt's last one (`raw`:
    the prompt's own)."""
    tok = host.backend.tokenizer
    prompt = tok.encode(PROMPT if raw else tok.apply_chat_template([{"role": "user", "content": PROMPT}], True))
    vocab = host.backend.info.vocab_size
    return tok.decode([(prompt[-1] + 1 + i) % vocab for i in range(tokens)])


def expected_steps(host: Host, tokens: int) -> str:
    """The stepper guest's output on the stand-in: the tokens after the prompt's last one."""
    last = host.backend.tokenizer.encode(PROMPT)[-1]
    return " ".join(str(last + 1 + i) for i in range(tokens))


def workload_args(name: str, tokens: int) -> list[str]:
    if name == "app":
        return ["--prompt", PROMPT, "--max-tokens", str(tokens)]
    return [str(tokens), PROMPT]


def run_once(host: Host, program: str, args: list[str], n: int, want: str, step_s: float,
             tokens: int, log: BatchLog | None = None) -> dict[str, float]:
    """One burst of n. `launch_ms`: the launching thread's time to make the n launches. With `log`
    (the stand-in's calls), also `ramp_ms`: from the first launch to the first backend call with 90%
    of the n in it (the instances' starts, bench/HISTORY.md); `period_ms`: the median time from one
    backend call's start to the next's, both holding every one of the n (the step, plus the host's
    work per step that the backend waits for); `tail_ms`: from the end of the last backend call to
    the last instance's end event."""
    before = host.scheduler.stats.as_dict()
    logged = len(log.calls) if log is not None else 0
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    w0, f0 = workers_cpu_s(host), workers_faults(host)
    t0 = time.perf_counter()
    runs = [Run(host, program, args) for _ in range(n)]
    launched = time.perf_counter()
    for r in runs:
        end = r.finish(600)
        if end.event != "completed" or end.message != want:
            raise RuntimeError(f"wrong result: {end.event}: {end.message[:200]!r} (expected {want[:80]!r})")
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    w1, f1 = workers_cpu_s(host), workers_faults(host)
    after = host.scheduler.stats.as_dict()
    mean_batch = (after["forwards"] - before["forwards"]) / max(after["batches"] - before["batches"], 1)
    tok_s = n * tokens / wall
    ideal = n * tokens / ((tokens + 1) * step_s)
    phases: dict[str, float] = {"launch_ms": round(1000 * (launched - t0), 1)}
    if log is not None:
        calls = sorted(log.calls[logged:])
        full = [start for start, _end, size in calls if size >= 0.9 * n]
        phases["ramp_ms"] = round(1000 * (full[0] - t0), 1) if full else float("nan")
        periods = [1000 * (b[0] - a[0]) for a, b in zip(calls, calls[1:], strict=False) if a[2] == n and b[2] == n]
        phases["period_ms"] = round(statistics.median(periods), 3) if periods else float("nan")
        last_call = max((end for _start, end, _size in calls), default=float("nan"))
        phases["tail_ms"] = round(1000 * (max(r.ended_at for r in runs) - last_call), 1)
    return {**phases, "tok_s": round(tok_s, 1), "ideal_tok_s": round(ideal, 1), "efficiency": round(tok_s / ideal, 3),
            "mean_batch": round(mean_batch, 1), "wall_s": round(wall, 3),
            # the process's CPU and page faults during the burst, per instance (starts, runs, ends,
            # and what the warm pool and the reaper did meanwhile)
            "cpu_ms_per_instance": round(1000 * (ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime) / n, 2),
            "sys_ms_per_instance": round(1000 * (ru1.ru_stime - ru0.ru_stime) / n, 2),
            "faults_per_instance": round((ru1.ru_minflt - ru0.ru_minflt) / n, 1),
            **({} if w0 is None or w1 is None else {"workers_cpu_ms_per_instance": round(1000 * (w1 - w0) / n, 2)}),
            **({} if f0 is None or f1 is None else {"workers_faults_per_instance": round((f1 - f0) / n, 1)})}


def workers_faults(host: Host) -> int | None:
    """Minor page faults of the host's instance workers so far (None without workers, or where /proc
    cannot tell): `faults_per_instance` counts the host's process only."""
    if host.workers is None:
        return None
    total = 0
    for w in host.workers.stats():
        try:
            with open(f"/proc/{w['pid']}/stat") as f:
                total += int(f.read().rsplit(")", 1)[1].split()[7])
        except (OSError, IndexError, ValueError):
            return None
    return total


def workers_cpu_s(host: Host) -> float | None:
    """CPU seconds of the host's instance workers so far (None without workers, or where /proc
    cannot tell): with `cpu_ms_per_instance`, the whole cost of an instance."""
    if host.workers is None:
        return None
    cpus = [w["cpu_s"] for w in host.workers.stats()]
    return None if any(c is None for c in cpus) else sum(cpus)


def measure(host: Host, step_s: float, program: str, args: list[str], n: int, want: str,
            tokens: int, bursts: int = 3, cold: bool = True) -> dict[str, float]:
    """Bursts of n as the host runs by default, then (with `cold`) bursts of n cold starts; the
    median of each.

    An unmeasured burst of n goes first: the first time n instances run at once, the pooling
    allocator maps their slots and faults their pages in (once per slot, host/wasm/pooling.py),
    and the warm pool learns that the program runs n at once; a long-running host has done both.
    Each default burst starts once the pool has refilled and the finished stores are freed (both
    happen while the host is idle)."""
    auto = host.warm.auto
    run_once(host, program, args, n, want, step_s, tokens)
    runs = []
    for _ in range(bursts):
        settle(host, program, n)
        runs.append(run_once(host, program, args, n, want, step_s, tokens))
    if not cold:
        return _median(runs)
    host.warm.auto = 0  # cold: the pool off and emptied
    host.prewarm(program, 0)
    cold_runs = []
    try:
        for _ in range(bursts):
            settle(host, program, 0)  # the parked instances' and the last burst's stores freed too
            cold_runs.append(run_once(host, program, args, n, want, step_s, tokens))
    finally:
        host.warm.auto = auto
    default, cold = _median(runs), _median(cold_runs)
    return {**default, **{f"cold_{k}": v for k, v in cold.items() if k != "ideal_tok_s"}}


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median efficiency (all its numbers, so they stay consistent)."""
    return sorted(runs, key=lambda r: r["efficiency"])[len(runs) // 2]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rss_per_instance(host: Host, program: str, n: int = 256) -> float:
    """Resident memory added per live instance (each holding a prompt in the cache, waiting)."""
    before = rss_mb()
    runs = [Run(host, program, ["1", PROMPT, "--hold"]) for _ in range(n)]
    deadline = time.monotonic() + 300
    while sum(i["state"] == "running" for i in host.instances()) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # let the last ones reach receive()
    during = rss_mb()
    for r in runs:
        host.signal(r.id, "go")
    for r in runs:
        r.finish(600)
    return round((during - before) / n, 2)


def back_to_back(opts: argparse.Namespace) -> dict[str, Any]:
    """{step: {backend: {n: {variant: {"fresh": ..., "back_to_back": ..., "back_to_back_all": [...]}}}}}."""
    out: dict[str, Any] = {}
    for step_ms in opts.step_ms:
        step_s = step_ms / 1000
        for backend, backend_config in BACKENDS.items():
            if backend not in opts.backends:
                continue
            for n in opts.instances:
                for variant in opts.variants:
                    with patched(**VARIANTS[variant].get("patch", {})):
                        row = traffic(opts, step_s, n, {**backend_config, **VARIANTS[variant].get("config", {})},
                                      VARIANTS[variant]["warm_start"])
                    out.setdefault(f"{step_ms:g}", {}).setdefault(backend, {}).setdefault(str(n), {})[variant] = row
                    print(f"{step_ms:g} ms {backend} {n} {variant}: {json.dumps(row)}", flush=True)
    return out


@contextlib.contextmanager
def patched(starts_wait: bool = True, prime_factor: int | None = None, fast_values: bool = True,
            reuse_slots: bool = True) -> Iterator[None]:
    """Module settings a variant changes for its host: `starts_wait` False = launched instances'
    starts do not hold refills and frees back (`Starts.active` always False); `prime_factor`:
    slots `Host.warm_start` primes per parked instance; `fast_values` False: lists and records
    cross host calls as wasmtime-py converts them (`fastcall.wasmtime_py_values`); `reuse_slots`
    False: the warm pool waits for every queued store to be freed, reusable slots or not."""
    saved_active, saved_factor = Starts.active, warm_module.PRIME_FACTOR
    saved_reusable = getattr(WasmEngine, "reusable_slots", None)  # (absent from trees before it, as 1061fa1)
    if not reuse_slots:
        WasmEngine.reusable_slots = lambda self: 0  # type: ignore[method-assign]
    if not starts_wait:
        Starts.active = lambda self: False  # type: ignore[method-assign]
    if prime_factor is not None:
        warm_module.PRIME_FACTOR = prime_factor
    try:
        with contextlib.nullcontext() if fast_values else fastcall.wasmtime_py_values():
            yield
    finally:
        Starts.active = saved_active  # type: ignore[method-assign]
        warm_module.PRIME_FACTOR = saved_factor
        if saved_reusable is not None:
            WasmEngine.reusable_slots = saved_reusable  # type: ignore[method-assign]


def inferlet_wasm(opts: argparse.Namespace, name: str) -> bytes:
    """A standard inferlet's component: built here (cached), or NAME.wasm from --inferlets (a machine
    without the guest toolchain, such as the GPU kit's: bench/gpu_suite.py --prepare)."""
    if opts.inferlets is not None:  # NAME.wasm, or NAME.wasm.gz as the kit carries it
        plain = opts.inferlets / f"{name}.wasm"
        return plain.read_bytes() if plain.is_file() else gzip.decompress((opts.inferlets / f"{name}.wasm.gz").read_bytes())
    return resolve_inferlet(name, quiet=True).read_bytes()


def traffic(opts: argparse.Namespace, step_s: float, n: int, config: dict[str, Any],
            warm_start: tuple[str, ...]) -> dict[str, Any]:
    """A fresh host's first burst of n, then `opts.bursts` bursts each right after the last."""
    log: list[BatchLog] = []
    host = make_host(opts.engine, step_s, log=log, **config)
    try:
        if warm_start:  # as pie-serve does before it listens
            host.warm_start([inferlet_wasm(opts, name) for name in warm_start])
        program = host.compile(inferlet_wasm(opts, "text_completion"))
        want = expected_text(host, opts.tokens)
        args = workload_args("app", opts.tokens)
        runs = []
        for _ in range(1 + opts.bursts):
            ready = host.warm.ready_count(program)  # parked instances this burst's launches find
            runs.append({**run_once(host, program, args, n, want, step_s, opts.tokens, log[0] if log else None),
                         "warm_ready": ready})
    finally:
        host.shutdown()
    fresh, runs = runs[0], runs[1:]
    return {"fresh": fresh, "back_to_back": _median(runs), "back_to_back_all": [r["efficiency"] for r in runs],
            "warm_ready_all": [r["warm_ready"] for r in runs]}


def traffic_table(results: dict[str, Any], tokens: int) -> str:
    lines = [f"# bench/host_scale.py --back-to-back (`app`, {tokens} tokens per instance; efficiency = "
             "tok/s / ideal; fresh = a fresh host's first burst, back-to-back = median of the bursts after it)", "",
             "| step ms | backend | instances | variant | fresh | back-to-back | all back-to-back | warm at launch "
             "| launch / ramp / period / tail ms (back-to-back) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for step, by_backend in results.items():
        for backend, by_n in by_backend.items():
            for n, by_variant in by_n.items():
                for variant, r in by_variant.items():
                    b = r["back_to_back"]
                    lines.append(f"| {step} | {backend} | {n} | {variant} | {r['fresh']['efficiency']} | "
                                 f"{r['back_to_back']['efficiency']} | {r['back_to_back_all']} | "
                                 f"{r['fresh']['warm_ready']}, {r['warm_ready_all']} | "
                                 + " / ".join(str(b.get(k)) for k in ("launch_ms", "ramp_ms", "period_ms", "tail_ms"))
                                 + " |")
    return "\n".join(lines) + "\n"


def table(results: dict[str, Any], rss: float, tokens: int, engine: str) -> str:
    lines = [f"# bench/host_scale.py ({tokens} tokens per instance; efficiency = tok/s / ideal; "
             f"--engine {engine})", ""]
    for step, by_workload in results.items():
        for workload, by_n in by_workload.items():
            lines += [f"## {step} ms step, `{workload}`", "", "| instances | " + " | ".join(by_n) + " |",
                      "|---|" + "---|" * len(by_n)]
            for key in ("tok_s", "ideal_tok_s", "efficiency", "efficiency_rounds", "mean_batch", "cold_tok_s",
                        "cold_efficiency"):
                if any(key in v for v in by_n.values()):
                    lines.append(f"| {key} | " + " | ".join(str(v.get(key, "")) for v in by_n.values()) + " |")
            lines.append("")
    lines.append(f"rss per live instance: {rss} MB")
    return "\n".join(lines) + "\n"


def settled(opts: argparse.Namespace) -> dict[str, Any]:
    """{step: {workload[@variant]: {n: entry}}}: each workload and variant on a host of its own (see the
    module doc), `opts.rounds` times in turn; an entry is the round with the median efficiency."""
    rounds: dict[tuple[str, str, str], list[dict[str, float]]] = {}
    workloads = tuple(opts.workloads) + (("app_no_feed",) if opts.compare_feed else ())
    for _ in range(opts.rounds):
        for step_ms in opts.step_ms:
            key = f"{step_ms:g}"
            for workload in workloads:
                for variant in opts.variants:
                    label = workload if variant == "default" else f"{workload}@{variant}"
                    config = {**({"warm_yield": False} if opts.no_warm_yield else {}),
                              **VARIANTS[variant].get("config", {})}
                    with patched(**VARIANTS[variant].get("patch", {})):
                        row = settled_entry(opts, step_ms / 1000, workload, config)
                    for n, entry in row.items():
                        rounds.setdefault((key, label, n), []).append(entry)
                    print(key, label, json.dumps(row), flush=True)
    results: dict[str, Any] = {}
    for (key, label, n), entries in rounds.items():
        entry = _median(entries)
        if opts.rounds > 1:
            entry = {**entry, "efficiency_rounds": [e["efficiency"] for e in entries]}
        results.setdefault(key, {}).setdefault(label, {})[n] = entry
    return results


def settled_entry(opts: argparse.Namespace, step_s: float, workload: str, config: dict[str, Any]) -> dict[str, Any]:
    """{n: measure(...)} for every --instances, on a fresh host with HostConfig `config`."""
    host = make_host(opts.engine, step_s, feed=workload != "app_no_feed", **config)
    try:
        app = workload != "step"
        program = compile_inferlet(host, "text_completion" if app else ROOT / "bench" / "inferlets" / "stepper")
        want = expected_text(host, opts.tokens) if app else expected_steps(host, opts.tokens)
        args = workload_args("app" if app else "step", opts.tokens)
        run_once(host, program, args, 1, want, step_s, opts.tokens)
        return {str(n): measure(host, step_s, program, args, n, want, opts.tokens, opts.bursts, not opts.no_cold)
                for n in opts.instances}
    finally:
        host.shutdown()


def sequence(opts: argparse.Namespace) -> dict[str, Any]:
    """{step: {variant: {"sizes", "efficiency" (per burst, per round), "by_size" (the median of each
    size's bursts over the rounds)}}}: bursts of `opts.sequence` sizes back to back on a fresh host
    behind a forward-only backend, each variant on hosts of its own, `opts.rounds` times in turn."""
    out: dict[str, Any] = {}
    for step_ms in opts.step_ms:
        step_s = step_ms / 1000
        runs: dict[str, list[list[dict[str, float]]]] = {v: [] for v in opts.variants}
        for _ in range(opts.rounds):
            for variant in opts.variants:
                with patched(**VARIANTS[variant].get("patch", {})):
                    host = make_host(opts.engine, step_s, forward_only=opts.engine == "inproc",
                                     **VARIANTS[variant].get("config", {}))
                    try:
                        program = host.compile(inferlet_wasm(opts, "text_completion"))
                        want = expected_text(host, opts.tokens, raw=True)
                        args = workload_args("app", opts.tokens) + ["--raw"]
                        runs[variant].append([run_once(host, program, args, n, want, step_s, opts.tokens)
                                              for n in opts.sequence])
                    finally:
                        host.shutdown()
                print(f"{step_ms:g} ms sequence {opts.sequence} {variant}: "
                      f"{[r['efficiency'] for r in runs[variant][-1]]}", flush=True)
        for variant, rounds in runs.items():
            effs = [[r["efficiency"] for r in burst] for burst in rounds]
            by_size = {str(n): round(statistics.median(e for burst in effs
                                                       for m, e in zip(opts.sequence, burst, strict=True) if m == n), 3)
                       for n in dict.fromkeys(opts.sequence)}
            out.setdefault(f"{step_ms:g}", {})[variant] = {
                "sizes": opts.sequence, "efficiency": effs, "by_size": by_size,
                "cpu_ms_per_instance": [[r["cpu_ms_per_instance"] for r in burst] for burst in rounds]}
    return out


def sequence_table(res: dict[str, Any]) -> str:
    lines = ["## `sequence`: bursts back to back, a forward-only backend, `text_completion --raw`", "",
             "| step ms | variant | bursts | efficiency per burst (each round) | median by size |", "|---|---|---|---|---|"]
    for step, by_variant in res.items():
        for variant, r in by_variant.items():
            lines.append(f"| {step} | {variant} | {r['sizes']} | {r['efficiency']} | "
                         + ", ".join(f"{n}: {e}" for n, e in r["by_size"].items()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    opts = parse_args()
    if opts.back_to_back:
        res = back_to_back(opts)
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"back_to_back": res, "tokens": opts.tokens, "engine": opts.engine,
                                         "cores": os.cpu_count()},
                                        indent=2))
        md = traffic_table(res, opts.tokens)
        opts.json.with_suffix(".md").write_text(md)
        print(md)
        return
    results = settled(opts) if opts.workloads else {}
    seq = sequence(opts) if opts.sequence else {}
    host = make_host(opts.engine, 0.0)  # memory per instance, on a host with no delay
    try:
        host.warm.auto = 0  # count started instances only: no parked ones before or during
        rss = rss_per_instance(host, compile_inferlet(host, ROOT / "bench" / "inferlets" / "stepper"),
                               32 if opts.quick else 256)
    finally:
        host.shutdown()
    res = {**results, "sequence": seq, "rss_mb_per_instance": rss, "tokens": opts.tokens, "engine": opts.engine}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    md = table(results, rss, opts.tokens, opts.engine) + ("\n" + sequence_table(seq) if seq else "")
    opts.json.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
