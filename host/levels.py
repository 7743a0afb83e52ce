"""Service levels: an instance's priority, aging, tenants served in turn, and their counters.

Rules (the same for the launch queue, `host/launch_queue.py`, and the choice of queued forwards
for a full batch, `host/batching/queue.py`):

- **Priority.** An int in [`PRIORITY_MIN`, `PRIORITY_MAX`], as vLLM's: lower runs sooner, 0 by
  default. It matters only where not everything fits: a full batch, a full instance cap, KV
  pressure (the highest number is suspended first).
- **Aging.** A waiter that has waited `aging_s` (`HostConfig.priority_aging_s`, 2 s) is promoted
  to the best priority waiting (counted once in `aged`), where tenants still take turns; among
  waiters of the same rank and turn, promoted ones go first, oldest first. So nothing waits more
  than `aging_s` plus its tenant's turns at the best priority for its priority's sake. (Until
  issue 52's re-measure aging put aged waiters ahead of every tenant: a tenant's flood, all aged
  after 2 s, then went ahead of another tenant's new request until the flood had prefilled:
  bench/qos.py's tenant B waited 2-3 s.)
- **Tenants in turn.** Within one (effective) priority, tenants are served round-robin: the
  k-th waiter of each tenant goes before the (k+1)-th of any, and among tenants with the same
  k the one served least recently goes first. A tenant that floods the host delays only itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

__all__ = ["PRIORITY_MIN", "PRIORITY_MAX", "DEFAULT_AGING_S", "check_priority", "Turns", "LevelStats"]

PRIORITY_MIN = -1000
PRIORITY_MAX = 1000
DEFAULT_AGING_S = 2.0
AGED = PRIORITY_MIN - 1  # the effective priority of a waiter past `aging_s`

T = TypeVar("T")


def check_priority(value: object, name: str = "priority") -> int:
    """`value` as a priority; TypeError / ValueError naming `name` and the bad value otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer from {PRIORITY_MIN} to {PRIORITY_MAX} "
                        f"(lower runs sooner), got {value!r}")
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise ValueError(f"{name} must be from {PRIORITY_MIN} to {PRIORITY_MAX} (lower runs sooner), got {value}")
    return value


class Turns:
    """Orders waiters by the rules above; remembers which tenant was served when (not thread-safe:
    its owner's lock guards it)."""

    def __init__(self, aging_s: float = DEFAULT_AGING_S) -> None:
        self.aging_s = aging_s
        self._served: dict[str, int] = {}  # tenant -> the turn it was last served in
        self._turn = 0

    def order(self, items: Sequence[T], priority: Callable[[T], int], tenant: Callable[[T], str],
              since: Callable[[T], float], now: float) -> list[T]:
        """`items` (in arrival order) in the order they should be served."""
        waits = [now - since(it) for it in items]
        prios = [priority(it) for it in items]
        top = min(prios, default=0)
        ranks: dict[tuple[int, str], int] = {}
        keys: list[tuple[int, int, int, int, float, int]] = []
        for i, it in enumerate(items):
            waited = waits[i]
            aged = waited >= self.aging_s
            prio = min(prios[i], top) if aged else prios[i]  # aged: up to the best priority waiting
            ten = tenant(it)
            rank = ranks.get((prio, ten), 0)
            ranks[(prio, ten)] = rank + 1
            # by rank, then the tenant served least lately, then aged waiters (oldest first)
            keys.append((prio, rank, self._served.get(ten, -1), 0 if aged else 1, -waited if aged else 0.0, i))
        return [items[k[-1]] for k in sorted(keys)]

    def served(self, tenants: Iterable[str] | dict[str, int]) -> None:
        """These tenants were served in this turn (they go after the others at the same rank next).
        A dict: how much each got (tokens); the more a tenant got, the later it goes next time, so
        tenants sharing a batch's prefill budget take turns at its head (else a tie would go to the
        earliest queued, every batch)."""
        if not isinstance(tenants, dict):
            self._turn += 1
        for t in sorted(tenants, key=tenants.__getitem__) if isinstance(tenants, dict) else tenants:
            self._turn += isinstance(tenants, dict)
            self._served[t] = self._turn
        if len(self._served) > 4096:  # tenants come and go: keep the most recent
            keep = sorted(self._served.items(), key=lambda kv: -kv[1])[:1024]
            self._served = dict(keep)

    def aged(self, since: float, now: float) -> bool:
        return now - since >= self.aging_s


class _Waits:
    __slots__ = ("count", "total_s", "max_s")

    def __init__(self) -> None:
        self.count, self.total_s, self.max_s = 0, 0.0, 0.0

    def add(self, s: float) -> None:
        self.count += 1
        self.total_s += s
        self.max_s = max(self.max_s, s)

    def as_dict(self) -> dict[str, float]:
        return {"count": self.count, "wait_s_total": round(self.total_s, 6), "wait_s_max": round(self.max_s, 6),
                "wait_s_mean": round(self.total_s / self.count, 6) if self.count else 0.0}


class LevelStats:
    """Waits (from queued to taken) per priority and per tenant, and aged promotions. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_priority: dict[int, _Waits] = {}
        self.by_tenant: dict[str, _Waits] = {}
        self.aged = 0

    def waited(self, priority: int, tenant: str, seconds: float) -> None:
        with self._lock:
            self.by_priority.setdefault(priority, _Waits()).add(seconds)
            self.by_tenant.setdefault(tenant, _Waits()).add(seconds)

    def waited_many(self, waits: Iterable[tuple[int, str, float]]) -> None:
        """`waited` for each (priority, tenant, seconds), under one lock."""
        with self._lock:
            bp, bt = self.by_priority, self.by_tenant
            for p, t, s in waits:
                (bp.get(p) or bp.setdefault(p, _Waits())).add(s)
                (bt.get(t) or bt.setdefault(t, _Waits())).add(s)

    def promoted(self, n: int = 1) -> None:
        with self._lock:
            self.aged += n

    def as_dict(self, depth: Iterable[tuple[int, str]] = ()) -> dict[str, Any]:
        """Counters, with the queue depth now from `depth` (each waiter's priority and tenant)."""
        by_p: dict[int, int] = {}
        by_t: dict[str, int] = {}
        for p, t in depth:
            by_p[p] = by_p.get(p, 0) + 1
            by_t[t] = by_t.get(t, 0) + 1
        with self._lock:
            prios = sorted(set(self.by_priority) | set(by_p))
            tenants = sorted(set(self.by_tenant) | set(by_t))
            return {"aged": self.aged,
                    "by_priority": {str(p): {"queued": by_p.get(p, 0),
                                             **self.by_priority.get(p, _Waits()).as_dict()} for p in prios},
                    "by_tenant": {t: {"queued": by_t.get(t, 0), **self.by_tenant.get(t, _Waits()).as_dict()}
                                  for t in tenants}}
