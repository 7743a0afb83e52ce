"""Prometheus metrics of one server (issue 14).

Invariant: each `ServerMetrics` owns its own `CollectorRegistry` (never the global one), so two
servers in one process never share or double-register series. Host-wide numbers are read from
`Host.stats()` at scrape time, so nothing runs on the scheduler's hot path; request-level
latencies (TTFT, TPOT) and instance ends are observed by the server as they happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

# KV pressure (host/suspend.py): Host.stats()["memory"] key -> metric
_KV_PRESSURE: list[tuple[type[CounterMetricFamily] | type[GaugeMetricFamily], str, str, str]] = [
    (CounterMetricFamily, "pie_kv_suspensions", "Instances suspended to host memory under KV pressure", "suspensions"),
    (CounterMetricFamily, "pie_kv_resumes", "Suspended instances resumed", "resumes"),
    (CounterMetricFamily, "pie_kv_swapped_pages", "KV pages copied out to host memory", "swapped_pages"),
    (CounterMetricFamily, "pie_kv_swapped_bytes", "Bytes of KV copied out to host memory", "swapped_bytes"),
    (CounterMetricFamily, "pie_kv_out_of_resources", "Allocations that could never be met", "out_of_resources"),
    (GaugeMetricFamily, "pie_kv_instances_suspended", "Instances suspended now", "suspended"),
    (GaugeMetricFamily, "pie_kv_allocations_waiting", "Allocations waiting for KV pages now", "waiting"),
    (GaugeMetricFamily, "pie_kv_swap_used_bytes", "Host memory held by suspended instances' KV", "swap_used_bytes"),
]


class _HostCollector(Collector):
    """Turns one `Host.stats()` snapshot into gauges and counters per scrape."""

    def __init__(self, stats: Callable[[], dict[str, Any]], queued: Callable[[], int]) -> None:
        self._stats = stats
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        sched: dict[str, Any] = {"batches": 0, "forwards": 0, "tokens": 0, "backend_errors": 0,
                                 "mean_batch_size": 0.0, "lookaheads": 0, "lookaheads_withdrawn": 0,
                                 "chunked_prefills": 0, "prefill_chunks": 0, "prefill_budget": 0,
                                 "step_fixed_ms": 0.0, "step_token_us": 0.0, **s.get("scheduler", {})}
        free, total = s["free_pages"], s["total_pages"]
        yield GaugeMetricFamily("pie_instances_running", "Instances running", value=s["instances"])
        lq = {"queued": self._queued(), "queued_total": 0, "timeouts": 0, **s.get("launch_queue", {})}
        yield GaugeMetricFamily("pie_instances_queued", "Launches waiting for an instance slot (--max-instances)",
                                value=lq["queued"])
        yield GaugeMetricFamily("pie_kv_pages_free", "KV pages free", value=free)
        yield GaugeMetricFamily("pie_kv_pages_used", "KV pages in use", value=total - free)
        yield CounterMetricFamily("pie_batches", "Batches run by the scheduler", value=sched["batches"])
        yield CounterMetricFamily("pie_forwards", "Forward passes merged into batches",
                                  value=sched["forwards"])
        yield CounterMetricFamily("pie_batch_tokens", "Tokens run through forward passes",
                                  value=sched["tokens"])
        yield CounterMetricFamily("pie_forward_errors", "Batches the backend failed",
                                  value=sched["backend_errors"])
        yield CounterMetricFamily("pie_step_lookaheads", "Decode steps of stepping guests run ahead of "
                                  "their call (host/api/lookahead.py)", value=sched["lookaheads"])
        yield CounterMetricFamily("pie_step_lookaheads_withdrawn", "Steps run ahead taken back before they ran "
                                  "(the guest's call was not the predicted one)", value=sched["lookaheads_withdrawn"])
        yield CounterMetricFamily("pie_chunked_prefills", "Forwards run in chunks, the running decodes stepping "
                                  "between them (--prefill-chunk)", value=sched["chunked_prefills"])
        yield CounterMetricFamily("pie_prefill_chunks", "Chunks the chunked forwards ran as, one batch each",
                                  value=sched["prefill_chunks"])
        yield GaugeMetricFamily("pie_prefill_budget_tokens", "With --prefill-chunk auto: the prefill tokens the "
                                "last batch with running decodes could take", value=sched["prefill_budget"])
        yield GaugeMetricFamily("pie_step_fixed_seconds", "With --prefill-chunk auto: a batch's fixed time, "
                                "fitted from the batches run", value=sched["step_fixed_ms"] / 1000)
        yield GaugeMetricFamily("pie_step_token_seconds", "With --prefill-chunk auto: a batch's time per new "
                                "token, fitted from the batches run", value=sched["step_token_us"] / 1e6)
        yield GaugeMetricFamily("pie_batch_size_mean", "Mean forwards per batch",
                                value=sched["mean_batch_size"])
        mem: dict[str, int] = {"suspensions": 0, "resumes": 0, "swapped_pages": 0, "swapped_bytes": 0,
                               "suspended": 0, "waiting": 0, "swap_used_bytes": 0, "out_of_resources": 0,
                               **s.get("memory", {})}  # KV pressure (host/suspend.py)
        for family, name, what, key in _KV_PRESSURE:
            yield family(name, what, value=mem[key])
        yield CounterMetricFamily("pie_launches_queued", "Launches that waited for an instance slot",
                                  value=lq["queued_total"])
        yield CounterMetricFamily("pie_launch_queue_timeouts", "Queued launches that waited past "
                                  "--launch-queue-timeout-s", value=lq["timeouts"])
        warm = s.get("warm_pool")
        if warm:  # launches by how they started (host/wasm/warm.py), and instances parked now
            starts = CounterMetricFamily("pie_launches", "Launches, by start: warm (a parked instance) or cold",
                                         labels=["start"])
            starts.add_metric(["warm"], warm["launches_warm"])
            starts.add_metric(["cold"], warm["launches_cold"])
            yield starts
            yield GaugeMetricFamily("pie_warm_instances_parked", "Warm instances parked, waiting for a launch",
                                    value=warm["parked"])
        levels = s.get("levels")
        if levels:
            yield from _level_metrics(levels)
        workers = s.get("workers")
        if workers:
            yield from _worker_metrics(workers)
        if "http" in s:
            yield from _outbound_metrics(s["http"], s.get("children", {}))
        counts = sched.get("batch_size_counts")
        if counts:  # the scheduler's batch-size histogram (forwards per batch)
            from host.batching.scheduler import BATCH_SIZE_BUCKETS

            cumulative, buckets = 0, []
            for bound, n in zip((*(str(float(b)) for b in BATCH_SIZE_BUCKETS), "+Inf"), counts, strict=True):
                cumulative += n
                buckets.append((bound, cumulative))
            yield HistogramMetricFamily("pie_batch_size", "Forward passes per batch", buckets=buckets,
                                        sum_value=sched["forwards"])


def _outbound_metrics(http: dict[str, Any], children: dict[str, Any]) -> Iterator[Metric]:
    """Inferlets' outbound HTTP (host/net) and child inferlets (host/children.py)."""
    reqs = CounterMetricFamily("pie_http_requests", "Outbound HTTP requests of inferlets, by outcome (ok, blocked, "
                                                    "invalid, too-large, timeout, busy, failed)", labels=["outcome"])
    for outcome in ("ok", "blocked", "invalid", "too-large", "timeout", "busy", "failed"):
        reqs.add_metric([outcome], http["requests"].get(outcome, 0))
    yield reqs
    yield GaugeMetricFamily("pie_http_in_flight", "Outbound HTTP requests in flight", value=http["in_flight"])
    sent = CounterMetricFamily("pie_http_bytes", "Outbound HTTP body bytes, by direction", labels=["direction"])
    sent.add_metric(["sent"], http["bytes_sent"])
    sent.add_metric(["received"], http["bytes_received"])
    yield sent
    if children:
        yield CounterMetricFamily("pie_children_launched", "Child inferlets launched (runtime.launch)",
                                  value=children["launched"])
        yield GaugeMetricFamily("pie_children_running", "Child inferlets running", value=children["running"])


def _worker_metrics(workers: dict[str, Any]) -> Iterator[Metric]:
    """Instance workers (host/workers/): how many, restarts, and per worker its instances, launches,
    host calls and CPU."""
    yield GaugeMetricFamily("pie_workers", "Instance worker processes (--workers; 0: instances run in the host)",
                            value=workers.get("count", 0))
    yield CounterMetricFamily("pie_worker_restarts", "Instance workers started again after one died",
                              value=workers.get("restarts", 0))
    running = GaugeMetricFamily("pie_worker_instances", "Instances running in the worker", labels=["worker"])
    launched = CounterMetricFamily("pie_worker_launches", "Instances placed on the worker", labels=["worker"])
    calls = CounterMetricFamily("pie_worker_calls", "Host calls the worker's guests made", labels=["worker"])
    on_reader = CounterMetricFamily("pie_worker_calls_on_reader", "Host calls of the worker's guests served on its "
                                    "reader thread in the host, without a wake-up of the instance's thread",
                                    labels=["worker"])
    steps = CounterMetricFamily("pie_worker_steps_on_reader", "Decode steps of the worker's guests served on its "
                                "reader thread in the host", labels=["worker"])
    cpu = CounterMetricFamily("pie_worker_cpu_seconds", "CPU seconds of the worker process", labels=["worker"])
    for w in workers.get("per_worker", []):
        label = [str(w["worker"])]
        running.add_metric(label, w["instances"])
        launched.add_metric(label, w["launched"])
        calls.add_metric(label, w["calls"])
        on_reader.add_metric(label, w.get("calls_on_reader", 0))
        steps.add_metric(label, w.get("steps_on_reader", 0))
        if w.get("cpu_s") is not None:
            cpu.add_metric(label, w["cpu_s"])
    yield from (running, launched, calls, on_reader, steps, cpu)


def _level_metrics(levels: dict[str, Any]) -> Iterator[Metric]:
    """Service levels (host/levels.py): queue depth, waits and aged promotions, for the launch queue
    and the forwards a full batch chooses from, by priority and by tenant."""
    depth = GaugeMetricFamily("pie_level_queued", "Waiting now, by queue (launch / forward), priority or tenant",
                              labels=["queue", "by", "level"])
    waits = CounterMetricFamily("pie_level_waits", "Waits ended (taken off the queue)", labels=["queue", "by", "level"])
    wait_s = CounterMetricFamily("pie_level_wait_seconds", "Seconds waited in the queue, summed",
                                 labels=["queue", "by", "level"])
    wait_max = GaugeMetricFamily("pie_level_wait_seconds_max", "The longest wait so far",
                                 labels=["queue", "by", "level"])
    aged = CounterMetricFamily("pie_level_aged_promotions", "Waiters promoted ahead of every priority by aging",
                               labels=["queue"])
    for queue, key in (("launch", "launch_queue"), ("forward", "forwards")):
        part = levels.get(key, {})
        aged.add_metric([queue], part.get("aged", 0))
        for by in ("priority", "tenant"):
            for level, row in part.get(f"by_{by}", {}).items():
                labels = [queue, by, str(level)]
                depth.add_metric(labels, row["queued"])
                waits.add_metric(labels, row["count"])
                wait_s.add_metric(labels, row["wait_s_total"])
                wait_max.add_metric(labels, row["wait_s_max"])
    yield from (depth, waits, wait_s, wait_max, aged)


class ServerMetrics:
    """Request-level metrics plus a scrape-time view of the host."""

    def __init__(self, stats: Callable[[], dict[str, Any]], queued: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_HostCollector(stats, queued))
        self.ttft = Histogram("pie_time_to_first_token_seconds", "Time to first token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pie_time_per_output_token_seconds", "Time per output token",
                              buckets=_TPOT_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter("pie_tokens_prefilled", "Prompt tokens prefilled",
                                     registry=self.registry)
        self.generated_tokens = Counter("pie_tokens_generated", "Tokens generated",
                                        registry=self.registry)
        self.ends = Counter("pie_instance_ends", "Instances ended, by reason", ["reason"],
                            registry=self.registry)

    def observe_request(self, ttft_s: float, total_s: float, prompt: int, generated: int) -> None:
        """Record one finished request: TTFT, mean TPOT over the tokens after the first."""
        self.ttft.observe(ttft_s)
        if generated > 1:
            self.tpot.observe((total_s - ttft_s) / (generated - 1))
        self.prompt_tokens.inc(prompt)
        self.generated_tokens.inc(generated)

    def instance_ended(self, reason: str) -> None:
        """Count an instance end (`finished`, `error`, `terminated`, ...)."""
        self.ends.labels(reason=reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)
