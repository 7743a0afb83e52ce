"""The launch queue: launches past `HostConfig.max_instances` wait here for an instance slot, and
are started in the service levels' order (host/levels.py: priority, aged first, tenants in turn);
one that waits past `launch_queue_timeout_s` ends with out_of_resources. A full queue refuses a
launch (`HostBusy`). The host holds its lock around every call here.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

from host.config import HostConfig
from host.levels import LevelStats, Turns
from host.wasm.instance import Instance

__all__ = ["HostBusy", "LaunchQueue"]


class HostBusy(RuntimeError):
    """A launch refused: `HostConfig.max_instances` instances are running and the launch queue is full."""


class LaunchQueue:
    """Queued launches, in arrival order, with their deadlines; counters for the host's stats."""

    def __init__(self, config: HostConfig) -> None:
        self.config = config
        self._queued: OrderedDict[str, tuple[Instance, float]] = OrderedDict()  # id -> (instance, deadline)
        self.queued_total = 0  # launches that waited in the queue, ever
        self.timeouts = 0
        self._turns = Turns(config.priority_aging_s)
        self.levels = LevelStats()

    def __len__(self) -> int:
        return len(self._queued)

    def __contains__(self, instance_id: str) -> bool:
        return instance_id in self._queued

    def push(self, inst: Instance) -> None:
        """Queue a cold instance not started yet; HostBusy if the queue is full."""
        cfg = self.config
        if len(self._queued) >= cfg.launch_queue:
            raise HostBusy(f"the host is running its maximum of {cfg.max_instances} instances and "
                           f"{len(self._queued)} launches wait for a slot (the launch queue holds "
                           f"{cfg.launch_queue}); try again when some have ended (or raise --max-instances "
                           "or --launch-queue)")
        inst.state = "queued"
        self._queued[inst.id] = (inst, time.perf_counter() + cfg.launch_queue_timeout_s)
        self.queued_total += 1

    def due(self, instances: int, now: float) -> list[Instance]:
        """Take the launches to start now, the host holding `instances` (running and queued): those that waited too
        long (terminated here) or were terminated (they end before running guest code, with their
        event), and as many as slots are free, in the service levels' order."""
        cfg = self.config
        start: list[Instance] = []
        for iid, (inst, deadline) in list(self._queued.items()):
            if inst.stop_reason is None and now > deadline:
                self.timeouts += 1
                inst.terminate(f"waited {cfg.launch_queue_timeout_s:g} s in the launch queue for one "
                               f"of the {cfg.max_instances} instance slots (--launch-queue-timeout-s)",
                               "out_of_resources")
            if inst.stop_reason is not None:
                del self._queued[iid]
                start.append(inst)
        free = cfg.max_instances - (instances - len(self._queued))
        if self._queued and free > 0:
            timeout = cfg.launch_queue_timeout_s
            waiting = list(self._queued.values())
            if free < len(waiting):
                waiting = self._turns.order(waiting, lambda w: w[0].pages.priority, lambda w: w[0].pages.tenant,
                                            lambda w: w[1] - timeout, now)[:free]
                self._turns.served(w[0].pages.tenant for w in waiting)
                self.levels.promoted(sum(1 for w in waiting if now - (w[1] - timeout) >= self._turns.aging_s))
            self.levels.waited_many((inst.pages.priority, inst.pages.tenant, now - (deadline - timeout))
                                    for inst, deadline in waiting)
            for inst, _deadline in waiting:
                del self._queued[inst.id]
                start.append(inst)
        return start

    def depth(self) -> list[tuple[int, str]]:
        """(priority, tenant) of each queued launch."""
        return [(i.pages.priority, i.pages.tenant) for i, _d in self._queued.values()]

    def as_dict(self) -> dict[str, Any]:
        return {"queued": len(self._queued), "queued_total": self.queued_total, "timeouts": self.timeouts,
                "limit": self.config.launch_queue}
