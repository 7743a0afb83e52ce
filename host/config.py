"""Host configuration: one frozen dataclass passed down to every part."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpu_backend.loading.paths import default_cache_dir
from host.batching.policy import POLICIES
from host.children import ChildLimits
from host.net.limits import HttpLimits
from host.state.prefix_cache import PREFIX_CACHE_MODES

__all__ = ["DTYPES", "ENGINES", "HostConfig", "default_cache_dir", "default_data_dir"]

DTYPES = ("float32", "bfloat16", "float16")
# where the backend runs (docs/deployment.md): "auto" = in the host process for one engine of one
# rank (measured faster on CPU: bench/engine.md), engine processes for --tp or --replicas > 1
ENGINES = ("auto", "inproc", "process")


def default_data_dir() -> Path:
    """Where a server keeps uploaded programs and the key-value store: $PIE_DATA_DIR, else the cache dir."""
    env = os.environ.get("PIE_DATA_DIR")
    return Path(env) if env else default_cache_dir()


@dataclass(frozen=True)
class HostConfig:
    """Everything the host needs to know at start-up.

    model: None for the default SmolLM2 GGUF, else a .gguf path or an HF safetensors dir.
    policy: "adaptive" (one batch in flight, fire all queued when it returns) or "k-or-t"
        (fire when `batch_k` forwards are queued or the oldest waited `batch_t_ms`).
    prefill_chunk: "auto" (the default) or an int. "auto": a batch with running decodes takes of
        each queued prefill at most as many tokens as would keep its predicted time within
        `prefill_ratio` decode-only steps were that prefill its only one (k prefills: k such shares,
        not one share for all, which starved agents' prefills on CPU: bench/agent_io.md), predicted
        from a running fit of the batches' times (fixed + per token) the scheduler measures
        (host/batching/stepcost.py); longer prompts run in chunks, one batch each, the
        running decodes stepping in every one (docs/architecture.md, "Chunked prefill"); a batch with
        no running decodes is capped by `max_batch_tokens` only. An int: a forward of more new tokens
        than this runs in chunks of at most this many, the chunks in one batch at most this many
        together, whatever a token costs; 0 = never split.
    prefill_ratio: with `prefill_chunk="auto"`, a batch with a prefill chunk and running decodes is
        sized to take at most this many times a decode-only step's time (1.5: issue 52's bound on the
        decodes' mean TPOT while a long prompt prefills); with k prefills queued, 1 + k * (ratio - 1).
    launch_grace_ms: with "adaptive", how long after the last launch onto an idle host a batch waits
        for the launched instances' first forwards (it fires as soon as all have come, or blocked on
        something else). 2 ms: a burst's instances join the batches as they come, best in front of the
        stand-in (host/batching/policy.py). Longer gathers a burst's first prefills into fewer launches,
        each of which an eager CUDA backend makes contended with the starting instances for the GIL
        (bench/gpu_suite_notes.md): an A/B for a GPU machine (`bench/gpu_suite.py --host-config`).
    memory_limit_bytes: cap on all linear memories and tables of one instance together.
    wall_budget_s: wall-clock budget per instance (None = unlimited).
    workers: instance worker processes (host/workers/): each runs guests on its own interpreter,
        while the scheduler, the pages and the backend stay in this process; 0 runs every guest
        here, on its instance's thread; "auto" (the default, or $PIE_WORKERS) = `auto_workers()` of
        the cores this process may use: as many as the cores, at most 8 (measured on 2 cores:
        bench/workers.py; docs/deployment.md, "Workers"). `worker_count` is what it resolves to.
    max_pages_per_instance: KV pages one instance may own at once (None = no cap).
    max_pages_per_tenant: KV pages the instances of one tenant may own at once together (None =
        no cap): one tenant cannot take the whole cache from the others.
    max_inbox_bytes: unread client messages (signals) per instance; a signal past it is refused.
    max_embedding_slots, max_embedding_bytes: embedding slots (WIT `embed`, host/api/embed.py) one
        instance may hold at once, by count and by their vectors' bytes; an `embed-text` /
        `embed-image` past either is an error result naming the limit (release some first).
    swap_memory_bytes: host memory for the KV of instances suspended under KV pressure (host/suspend.py);
        0 = never suspend (an instance that waits for pages nobody frees ends with out_of_resources).
    max_kv_store_bytes: UTF-8 bytes of keys and values one tenant may keep in the key-value store
        (host/state/kvstore.py); a `store.set` past it traps its caller.
    max_recording_bytes: bound of one recording of an instance's host calls (`Host.launch(record=True)`,
        host/replay/); past it the recording is marked truncated and stops growing.
    run_gate: instance threads take turns running, `run_slots` at a time (see host/batching/gate.py);
        False lets them all contend for the GIL at once (for comparisons).
    max_instances: instances running at once; a launch beyond it waits in the launch queue.
    launch_queue: launches that may wait for a free instance slot, in order; one more is refused
        (`HostBusy`); 0 = refuse at once. launch_queue_timeout_s: a launch that waited this long ends
        with `out_of_resources` without having run. The queue admits by priority, tenants in turn
        within one (host/levels.py).
    priority_aging_s: a launch or a queued forward that has waited this long goes ahead of every
        priority (host/levels.py), so a low-priority instance under constant load still runs.
    warm_instances: instances of each recently launched program kept started ahead of demand,
        waiting at their first host call (host/wasm/warm.py); 0 = none kept for their own sake.
    warm_auto: besides those, keep as many instances of each recent program warm as it has had
        running at once, up to this many parked in all; 0 = off (every launch beyond
        `warm_instances` starts cold).
    warm_yield: refill the warm pool and free finished stores while instances run, at the lowest
        CPU priority (host/wasm/priority.py), so bursts that come back to back find the pool full;
        False (or where a thread's priority cannot be raised back): only while the host is idle.
    instance_pool: use wasmtime's pooling allocator (host/wasm/pooling.py), sized for
        max_instances + the warm ones; False = on-demand allocation (slower starts).
    engine: where the backend runs: "inproc" (on the scheduler thread of the host process),
        "process" (in engine processes fed over pyzmq + msgpack, gpu_backend/engine/client.py), or
        "auto" (inproc for tp == replicas == 1, else process). See docs/deployment.md.
    tp: tensor-parallel ranks per engine (torch.distributed: NCCL on GPUs, gloo on CPU).
    replicas: engines, each with its own KV cache; an instance lives on one (placed by load).
    engine_restart: start an engine process again after it died (its instances end first).
    step_lookahead: run the predicted next `decode-step` of a guest that steps every token itself
        in the batch after the one that drew its token, while the guest runs (`Stepper` in
        host/api/lookahead.py; the guest's call claims it if its arguments are the predicted ones). False:
        every step waits for its guest's call (for comparisons).
    http_allow: `HOST[:PORT]` patterns every tenant's inferlets may reach over HTTP (host/net/policy.py);
        empty, the default: no outbound HTTP at all. http_tenant_allow: (tenant, pattern) pairs, more
        patterns for one tenant. http_limits: request and response sizes, time, requests in flight.
    child_limits: child inferlets (`runtime.launch`, host/children.py): depth, counts, detaching.
    run_ahead: use the backend's own `start_forward` (the torch backend's: on CUDA no host sync,
        on CPU a worker thread; the stand-in's): each batch of host-side generation loops is
        launched as soon as the last one's tokens are drawn, their steps prepared while it ran,
        and with a backend that takes a `Feed` before the last one is waited for, its tokens read
        on the device (docs/architecture.md, "Loops run ahead"). False: the backend's `forward` is run through
        `gpu_backend.types.started` on the same run path, so nothing overlaps (for comparisons).
    tune_gc: once started, move every object then alive (the model, tokenizer, modules: ~190k
        objects) out of reach of Python's cyclic GC (`gc.freeze`), so a full collection, which
        otherwise stops every thread for ~100-150 ms while the host serves, scans only what came
        after, and collect the young generation every 10,000 net allocations instead of 700 (a
        burst of 256 instances: ~70 young collections -> 1-2), and collect fully whenever the warm
        pool has refilled (the host is idle then), so that no middle or full collection comes due
        inside a burst. Shutdown undoes the first two. See `Host`.
    switch_interval_ms: the GIL switch interval the host sets for its process while it runs
        (`sys.setswitchinterval`; 0 leaves Python's 5 ms; None, the default: 0.5 ms when the
        backend runs on a CUDA device, else Python's). The scheduler's thread gives the GIL up
        at every torch call; while a burst starts (the launching thread and the instances run
        Python), each one took up to an interval to get it back, and an eager prefill makes hundreds
        of calls: on an H200, the first batch of a 256-instance burst took 552 ms at 5 ms and
        334 ms at 0.5 ms (bench/gpu_suite_notes.md). Elsewhere the short interval only makes the
        starting instances hand the GIL round ten times as often: behind a backend that has only
        `forward`, bursts of 64 ran at 0.54-0.59 of the ideal with 0.5 ms and 0.62-0.64 with 5 ms,
        256 unchanged (bench/HISTORY.md, issue 56). Shutdown of the last host restores it.
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None  # "float32" / "bfloat16" / "float16"; None = fp32 on CPU, bf16 on CUDA
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None  # None (and no num_pages): from gpu_memory_utilization on CUDA, 256 MiB on CPU
    gpu_memory_utilization: float = 0.9
    policy: str = "adaptive"
    max_batch_tokens: int = 10240
    prefill_chunk: int | str = "auto"
    prefill_ratio: float = 1.5
    batch_k: int = 8
    batch_t_ms: float = 16.0
    launch_grace_ms: float = 2.0
    memory_limit_bytes: int = 512 * 2**20
    wall_budget_s: float | None = None
    max_pages_per_instance: int | None = None
    max_pages_per_tenant: int | None = None
    max_inbox_bytes: int = 4 * 2**20
    max_embedding_slots: int = 256
    max_embedding_bytes: int = 256 * 2**20
    swap_memory_bytes: int = 4 * 2**30
    max_kv_store_bytes: int = 64 * 2**20
    max_recording_bytes: int = 64 * 2**20
    prefix_cache: str = "per-client"  # per-client | shared | off (host/state/prefix_cache.py)
    max_published_messages: int = 1024  # unread pub/sub messages kept per instance (oldest dropped)
    max_published_bytes: int = 2**20
    epoch_tick_ms: float = 10.0
    workers: int | str = field(default_factory=lambda: _env_workers("PIE_WORKERS"))
    run_gate: bool = True
    run_slots: int = 2
    max_instances: int = 1024
    launch_queue: int = 1024
    launch_queue_timeout_s: float = 300.0
    priority_aging_s: float = 2.0
    warm_instances: int = 0
    warm_auto: int = 256
    warm_yield: bool = True
    instance_pool: bool = True
    cache_dir: Path = field(default_factory=default_cache_dir)
    data_dir: Path | None = None  # key-value store file lives here; None = cache_dir
    engine: str = "auto"  # auto | inproc | process
    tp: int = 1
    replicas: int = 1
    engine_restart: bool = True
    tune_gc: bool = True
    switch_interval_ms: float | None = None
    step_lookahead: bool = True
    run_ahead: bool = True
    http_allow: tuple[str, ...] = ()
    http_tenant_allow: tuple[tuple[str, str], ...] = ()
    http_limits: HttpLimits = field(default_factory=HttpLimits)
    child_limits: ChildLimits = field(default_factory=ChildLimits)

    @property
    def worker_count(self) -> int:
        """The number of instance worker processes: `workers`, with "auto" resolved."""
        return auto_workers() if self.workers == "auto" else int(self.workers)

    @property
    def engine_kind(self) -> str:
        """"inproc" or "process": what `engine` resolves to."""
        if self.engine != "auto":
            return self.engine
        return "process" if self.tp > 1 or self.replicas > 1 else "inproc"

    def __post_init__(self) -> None:
        if self.workers != "auto" and (not isinstance(self.workers, int) or isinstance(self.workers, bool)
                                       or not 0 <= self.workers <= 256):
            raise ValueError(f"workers must be \"auto\" or an int in [0, 256] (0: instances run in this "
                             f"process), got {self.workers!r}")
        from host.net.policy import HttpPolicy  # (light: no httpx)

        HttpPolicy(self.http_allow + tuple(p for _t, p in self.http_tenant_allow))  # ValueError naming a bad one
        if self.policy not in POLICIES:
            raise ValueError(f"unknown batching policy {self.policy!r}: use one of {', '.join(POLICIES)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1, got {self.max_batch_tokens}")
        if self.prefill_chunk != "auto" and (isinstance(self.prefill_chunk, bool) or not isinstance(
                self.prefill_chunk, int) or self.prefill_chunk < 0):
            raise ValueError(f"prefill_chunk must be 'auto' or an int >= 0 (0 = never split), got {self.prefill_chunk!r}")
        if not 1.0 < self.prefill_ratio <= 100.0:
            raise ValueError(f"prefill_ratio must be in (1, 100], got {self.prefill_ratio}")
        if not 0 <= self.launch_grace_ms <= 10_000:
            raise ValueError(f"launch_grace_ms must be in [0, 10000], got {self.launch_grace_ms}")
        if self.batch_k < 1 or self.batch_t_ms < 0:
            raise ValueError(f"k-or-t needs batch_k >= 1 and batch_t_ms >= 0, got {self.batch_k}, {self.batch_t_ms}")
        if self.max_instances < 1 or self.warm_instances < 0 or self.warm_auto < 0:
            raise ValueError(f"max_instances must be >= 1, warm_instances and warm_auto >= 0, got "
                             f"{self.max_instances}, {self.warm_instances}, {self.warm_auto}")
        if self.switch_interval_ms is not None and not 0 <= self.switch_interval_ms <= 100:
            raise ValueError(f"switch_interval_ms must be in [0, 100], got {self.switch_interval_ms}")
        if self.run_slots < 1:
            raise ValueError(f"run_slots must be >= 1, got {self.run_slots}")
        if self.memory_limit_bytes < 1 << 20:
            raise ValueError(f"memory_limit_bytes must be at least 1 MiB, got {self.memory_limit_bytes}")
        if self.wall_budget_s is not None and self.wall_budget_s <= 0:
            raise ValueError(f"wall_budget_s must be positive, got {self.wall_budget_s}")
        if self.prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(f"unknown prefix_cache {self.prefix_cache!r}: use one of {', '.join(PREFIX_CACHE_MODES)}")
        if self.max_published_messages < 1 or self.max_published_bytes < 1:
            raise ValueError("max_published_messages and max_published_bytes must be >= 1, got "
                             f"{self.max_published_messages}, {self.max_published_bytes}")
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp must be an int >= 1, got {self.tp!r}")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if self.engine == "inproc" and (self.tp > 1 or self.replicas > 1):
            raise ValueError(f"tp={self.tp} / replicas={self.replicas} run in engine processes: use "
                             "engine='process' (or 'auto'), not 'inproc'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.launch_queue < 0 or not self.launch_queue_timeout_s > 0:
            raise ValueError(f"launch_queue must be >= 0 and launch_queue_timeout_s > 0, got {self.launch_queue}, "
                             f"{self.launch_queue_timeout_s}")
        if self.swap_memory_bytes < 0:
            raise ValueError(f"swap_memory_bytes must be >= 0, got {self.swap_memory_bytes}")
        if self.max_pages_per_instance is not None and self.max_pages_per_instance < 1:
            raise ValueError(f"max_pages_per_instance must be >= 1, got {self.max_pages_per_instance}")
        if self.max_pages_per_tenant is not None and self.max_pages_per_tenant < 1:
            raise ValueError(f"max_pages_per_tenant must be >= 1, got {self.max_pages_per_tenant}")
        if self.max_recording_bytes < 1:
            raise ValueError(f"max_recording_bytes must be >= 1, got {self.max_recording_bytes}")
        if self.max_embedding_slots < 1 or self.max_embedding_bytes < 1:
            raise ValueError(f"max_embedding_slots and max_embedding_bytes must be >= 1, got "
                             f"{self.max_embedding_slots}, {self.max_embedding_bytes}")
        if self.max_inbox_bytes < 1 or self.max_kv_store_bytes < 1:
            raise ValueError(f"max_inbox_bytes and max_kv_store_bytes must be >= 1, got {self.max_inbox_bytes}, "
                             f"{self.max_kv_store_bytes}")


AUTO_WORKERS_MAX = 8


def auto_workers(cores: int | None = None) -> int:
    """`workers="auto"`: one instance worker per core this process may use, at most
    `AUTO_WORKERS_MAX`; 0 on one core (a worker there only adds its messages). Measured with
    bench/workers.py (64 clients of `text_completion` behind a 2 ms step): on 2 cores, 2 workers
    ran the most completions per second (above 1 and 3; bench/workers.md)."""
    if cores is None:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # (not Linux)
            cores = os.cpu_count() or 1
    return 0 if cores < 2 else min(cores, AUTO_WORKERS_MAX)


def _env_workers(name: str) -> int | str:
    """$PIE_WORKERS: "auto" (also when unset) or a number."""
    raw = os.environ.get(name, "").strip()
    if raw in ("", "auto"):
        return "auto"
    return _env_int(name, 0)


def _env_int(name: str, default: int) -> int:
    """An int from the environment (a default a whole process, e.g. a test run, changes)."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None
