"""The host's numbers summed over its parts: replicas' level stats and KV pressure, engine
processes and worker processes, for `Host.stats` (the dashboard, /metrics and `pie-serve`'s stats).
"""

from __future__ import annotations

from typing import Any

from host.replicas import Replica
from host.workers.pool import WorkerPool

__all__ = ["engine_stats", "memory_totals", "merge_levels", "worker_stats"]


def merge_levels(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' forward queues' level stats as one (sums; the max of maxima)."""
    out: dict[str, Any] = {"aged": sum(p["aged"] for p in parts), "by_priority": {}, "by_tenant": {}}
    for part in parts:
        for key in ("by_priority", "by_tenant"):
            for name, row in part[key].items():
                acc = out[key].setdefault(name, {"queued": 0, "count": 0, "wait_s_total": 0.0, "wait_s_max": 0.0})
                for f in ("queued", "count", "wait_s_total"):
                    acc[f] += row[f]
                acc["wait_s_max"] = max(acc["wait_s_max"], row["wait_s_max"])
    for key in ("by_priority", "by_tenant"):
        for acc in out[key].values():
            acc["wait_s_mean"] = round(acc["wait_s_total"] / acc["count"], 6) if acc["count"] else 0.0
    return out


def memory_totals(replicas: list[Replica]) -> dict[str, int]:
    """The replicas' suspenders' counters (host/suspend.py), summed."""
    total: dict[str, int] = {}
    for r in replicas:
        if r.suspender is not None:
            for k, v in r.suspender.as_dict().items():
                total[k] = total.get(k, 0) + v
    return total


def worker_stats(workers: WorkerPool | None) -> dict[str, Any]:
    """The worker processes: how many, their restarts, each one's counters."""
    if workers is None:
        return {"count": 0}
    return {"count": len(workers.workers), "restarts": workers.restarts, "per_worker": workers.stats()}


def engine_stats(engines: list[Any], load: list[int], replicas: list[Replica]) -> dict[str, Any]:
    """The engine: in-process, or its processes (tensor-parallel ranks, and per replica its pid,
    liveness, deaths, instances placed and free pages)."""
    return {"kind": "process" if engines else "inproc",
            "tp": engines[0].spec.tp if engines else 1,
            "replicas": [{"pid": e.pid, "alive": e.alive, "deaths": e.deaths,
                          "instances": load[r], "free_pages": replicas[r].pages.free_count}
                         for r, e in enumerate(engines)]}
