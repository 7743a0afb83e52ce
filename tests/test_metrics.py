"""Fast tests of the server's Prometheus metrics (issue 14) over a fake stats snapshot."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from host.server.metrics import ServerMetrics


def _stats() -> dict[str, Any]:
    sched = {"batches": 7, "forwards": 21, "tokens": 90, "backend_errors": 1, "mean_batch_size": 3.0,
             "lookaheads": 12, "lookaheads_withdrawn": 2, "chunked_prefills": 3, "prefill_chunks": 17,
             "prefill_budget": 258, "step_fixed_ms": 10.0, "step_token_us": 20.0}
    return {"scheduler": sched, "instances": 2, "free_pages": 10, "total_pages": 64}


def _samples(m: ServerMetrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            key = s.name + "".join(f"{{{k}={v}}}" for k, v in sorted(s.labels.items())
                                   if k != "le")
            if "le" not in s.labels:
                out[key] = s.value
    return out


def test_host_view_and_requests() -> None:
    m = ServerMetrics(_stats, lambda: 3)
    m.observe_request(ttft_s=0.2, total_s=1.2, prompt=5, generated=11)
    m.instance_ended("finished")
    m.instance_ended("terminated")
    m.instance_ended("finished")
    s = _samples(m)
    assert s["pie_instances_running"] == 2 and s["pie_instances_queued"] == 3
    assert s["pie_kv_pages_free"] == 10 and s["pie_kv_pages_used"] == 54
    assert s["pie_batches_total"] == 7 and s["pie_forward_errors_total"] == 1
    assert s["pie_step_lookaheads_total"] == 12 and s["pie_step_lookaheads_withdrawn_total"] == 2
    assert s["pie_chunked_prefills_total"] == 3 and s["pie_prefill_chunks_total"] == 17
    assert s["pie_prefill_budget_tokens"] == 258 and abs(s["pie_step_fixed_seconds"] - 0.010) < 1e-12
    assert abs(s["pie_step_token_seconds"] - 20e-6) < 1e-12
    assert s["pie_tokens_prefilled_total"] == 5 and s["pie_tokens_generated_total"] == 11
    assert s["pie_time_to_first_token_seconds_count"] == 1
    assert abs(s["pie_time_per_output_token_seconds_sum"] - 0.1) < 1e-9
    assert s["pie_instance_ends_total{reason=finished}"] == 2
    assert s["pie_instance_ends_total{reason=terminated}"] == 1


def test_registries_are_per_server() -> None:
    a, b = ServerMetrics(_stats, lambda: 0), ServerMetrics(_stats, lambda: 0)
    a.observe_request(0.1, 0.1, 1, 1)
    assert _samples(b)["pie_tokens_generated_total"] == 0


def test_batch_size_histogram_from_the_scheduler() -> None:
    from host.batching.scheduler import BATCH_SIZE_BUCKETS, SchedulerStats

    st = SchedulerStats()
    st.batch_size_counts[0] += 2  # two batches of 1
    st.batch_size_counts[BATCH_SIZE_BUCKETS.index(4)] += 1  # one of 3 or 4
    st.batches, st.forwards = 3, 5
    m = ServerMetrics(lambda: {**_stats(), "scheduler": st.as_dict()}, lambda: 0)
    buckets = {s.labels["le"]: s.value for fam in text_string_to_metric_families(m.render().decode())
               for s in fam.samples if s.name == "pie_batch_size_bucket"}
    assert (buckets["1.0"], buckets["2.0"], buckets["4.0"], buckets["+Inf"]) == (2, 2, 3, 3)
    assert _samples(m)["pie_batch_size_sum"] == 5 and _samples(m)["pie_batch_size_count"] == 3


def test_scheduler_counts_batches_by_size() -> None:
    import bisect

    from host.batching.scheduler import BATCH_SIZE_BUCKETS

    assert [bisect.bisect_left(BATCH_SIZE_BUCKETS, n) for n in (1, 2, 3, 4, 5, 256, 257)] == [0, 1, 2, 2, 3, 8, 9]


def test_kv_pressure_and_the_launch_queue_from_the_host_stats() -> None:
    mem = {"suspensions": 4, "resumes": 3, "swapped_pages": 40, "swapped_bytes": 40 * 4096, "suspended": 1,
           "waiting": 2, "swap_used_bytes": 10 * 4096, "out_of_resources": 1}
    lq = {"queued": 5, "queued_total": 9, "timeouts": 2, "limit": 1024}
    s = _samples(ServerMetrics(lambda: {**_stats(), "memory": mem, "launch_queue": lq}, lambda: 0))
    assert s["pie_instances_queued"] == 5 and s["pie_launches_queued_total"] == 9
    assert s["pie_launch_queue_timeouts_total"] == 2
    assert s["pie_kv_suspensions_total"] == 4 and s["pie_kv_resumes_total"] == 3
    assert s["pie_kv_swapped_pages_total"] == 40 and s["pie_kv_swapped_bytes_total"] == 40 * 4096
    assert s["pie_kv_instances_suspended"] == 1 and s["pie_kv_allocations_waiting"] == 2
    assert s["pie_kv_swap_used_bytes"] == 10 * 4096 and s["pie_kv_out_of_resources_total"] == 1
    assert _samples(ServerMetrics(_stats, lambda: 0))["pie_kv_suspensions_total"] == 0  # a host without it


def test_launches_by_start_and_parked_instances_from_the_host_stats() -> None:
    warm = {"launches_warm": 12, "launches_cold": 3, "parked": 5}
    s = _samples(ServerMetrics(lambda: {**_stats(), "warm_pool": warm}, lambda: 0))
    assert s["pie_launches_total{start=warm}"] == 12 and s["pie_launches_total{start=cold}"] == 3
    assert s["pie_warm_instances_parked"] == 5
    assert "pie_warm_instances_parked" not in _samples(ServerMetrics(_stats, lambda: 0))  # a host without a pool


def test_worker_totals_and_per_worker_figures_from_the_host_stats() -> None:
    workers = {"count": 2, "restarts": 1, "per_worker": [
        {"worker": 0, "pid": 11, "instances": 3, "launched": 40, "calls": 120, "calls_on_reader": 105, "steps_on_reader": 90,
         "cpu_s": 1.5},
        {"worker": 1, "pid": 12, "instances": 0, "launched": 38, "calls": 100, "cpu_s": None}]}
    s = _samples(ServerMetrics(lambda: {**_stats(), "workers": workers}, lambda: 0))
    assert s["pie_workers"] == 2 and s["pie_worker_restarts_total"] == 1
    assert s["pie_worker_instances{worker=0}"] == 3 and s["pie_worker_instances{worker=1}"] == 0
    assert s["pie_worker_launches_total{worker=1}"] == 38 and s["pie_worker_calls_total{worker=0}"] == 120
    assert s["pie_worker_steps_on_reader_total{worker=0}"] == 90
    assert s["pie_worker_calls_on_reader_total{worker=0}"] == 105 and s["pie_worker_calls_on_reader_total{worker=1}"] == 0
    assert s["pie_worker_cpu_seconds_total{worker=0}"] == 1.5 and "pie_worker_cpu_seconds_total{worker=1}" not in s
    in_process = _samples(ServerMetrics(lambda: {**_stats(), "workers": {"count": 0}}, lambda: 0))
    assert in_process["pie_workers"] == 0 and not any(k.startswith("pie_worker_instances") for k in in_process)


def test_outbound_http_and_children_from_the_host_stats() -> None:
    http = {"requests": {"ok": 5, "blocked": 2, "timeout": 1}, "in_flight": 3, "bytes_sent": 100,
            "bytes_received": 4000}
    s = _samples(ServerMetrics(lambda: {**_stats(), "http": http, "children": {"launched": 7, "running": 2}},
                               lambda: 0))
    assert s["pie_http_requests_total{outcome=ok}"] == 5 and s["pie_http_requests_total{outcome=blocked}"] == 2
    assert s["pie_http_requests_total{outcome=too-large}"] == 0 and s["pie_http_in_flight"] == 3
    assert s["pie_http_bytes_total{direction=received}"] == 4000 and s["pie_http_bytes_total{direction=sent}"] == 100
    assert s["pie_children_launched_total"] == 7 and s["pie_children_running"] == 2
