"""The host's introspection: `HostStats` (its running instances, `Host.stats()` and the parts of it:
service levels, KV pressure), and the numbers summed over its replicas, engine processes and
worker processes (the dashboard, /metrics and `pie-serve`'s stats read them).
"""

from __future__ import annotations

import threading
from typing import Any

from host.children import Children
from host.config import HostConfig
from host.launch_queue import LaunchQueue
from host.net.client import HttpService
from host.replicas import Replica, total_stats
from host.state.pages import PageManager
from host.wasm.instance import Instance
from host.wasm.warm import WarmPool
from host.workers.pool import WorkerPool

__all__ = ["HostStats", "engine_stats", "memory_totals", "merge_levels", "worker_stats"]


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


class HostStats:
    """`Host`'s introspection: its running instances and its numbers (a part of `Host`, host/host.py)."""

    config: HostConfig
    model_name: str
    total_pages: int
    replicas: list[Replica]
    pages: PageManager
    queue: LaunchQueue
    http: HttpService
    children: Children
    warm: WarmPool
    workers: WorkerPool | None
    engines: list[Any]
    _load: list[int]
    _lock: threading.Lock
    _instances: dict[str, Instance]

    def instances(self) -> list[dict[str, Any]]:
        """The running instances: id, program, arguments, state, started_at, tenant, priority, and
        what each holds (`PageManager.usage`): pages, tokens (K/V slots written) and swapped pages."""
        with self._lock:
            insts = list(self._instances.values())
        out = []
        for i in insts:
            pages, tokens, swapped = self.replicas[i.pages.replica].pages.usage(i.pages)
            out.append({"id": i.id, "program": i.program, "arguments": i.args, "state": i.state,
                        "started_at": i.started_at, "tenant": i.pages.tenant, "priority": i.pages.priority,
                        "pages": pages, "tokens": tokens, "swapped": swapped})
        return out

    def model_names(self) -> list[str]:
        return [self.model_name]

    def free_pages(self) -> int:
        """KV pages on the free list now (all replicas)."""
        return sum(r.pages.free_count for r in self.replicas)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            running = len(self._instances) - len(self.queue)
            launch_queue = self.queue.as_dict()
        cache = self.pages.cache  # (with replicas: the first's; each has its own)
        return {"scheduler": total_stats(self.replicas).as_dict(), "policy": self.config.policy,
                "instances": running, "free_pages": self.free_pages(), "total_pages": self.total_pages,
                "launch_queue": launch_queue,
                "levels": self.level_stats(),
                "model": self.model_name,
                "prefix_cache": cache.as_dict() if cache is not None else {"mode": "off"},
                "memory": self.memory_stats(),
                "http": self.http.stats(),
                "children": self.children.stats(),
                "warm_pool": self.warm.as_dict(),
                "workers": worker_stats(self.workers),
                "engine": engine_stats(self.engines, self._load, self.replicas)}

    def level_stats(self) -> dict[str, Any]:
        """Service levels (host/levels.py): per priority and per tenant, the launch queue's and the
        batches' queue depth now and waits (count, total, mean, max seconds), and aged promotions."""
        with self._lock:
            depth = self.queue.depth()
        batches = [r.scheduler.level_stats() for r in self.replicas]
        forwards = batches[0] if len(batches) == 1 else merge_levels(batches)
        return {"aging_s": self.config.priority_aging_s, "launch_queue": self.queue.levels.as_dict(depth),
                "forwards": forwards}

    def memory_stats(self) -> dict[str, int]:
        """KV pressure (host/suspend.py), all replicas: suspensions, resumes, pages and bytes
        swapped out (ever), instances suspended and allocations waiting now, swap space used."""
        return memory_totals(self.replicas)
