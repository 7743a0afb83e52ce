"""Batching policies: when the scheduler fires the forwards it has queued.

A policy is consulted with the scheduler's lock held, so its methods must be quick and must
not block. Pie has the same cut (a `BatchPolicy` trait in its Rust host).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence

from host.batching.future import ForwardFuture

__all__ = ["AdaptivePolicy", "BatchPolicy", "KOrTPolicy", "POLICIES", "make_policy"]


class BatchPolicy(ABC):
    """Decides when the queue is worth a backend call."""

    name: str = ""

    @abstractmethod
    def ready(self, queue: Sequence[ForwardFuture], now: float) -> bool:
        """Whether to fire a batch now (the queue is not empty)."""

    @abstractmethod
    def wait_s(self, queue: Sequence[ForwardFuture], now: float) -> float | None:
        """How long the scheduler may sleep before `ready` can change without a submit (None: until one)."""

    def launched(self, owner: str, now: float) -> None:  # noqa: B027 - an optional hook
        """A new instance will submit soon."""

    def submitted(self, owner: str) -> None:  # noqa: B027 - an optional hook
        """`owner` queued a forward."""

    def expects(self, owner: str) -> bool:
        """Whether the policy is holding batches back for `owner` (read without the lock)."""
        return False

    def forget(self, owner: str) -> bool:
        """`owner` ended or blocked on something else; returns whether anything changed."""
        return False

    def batch_done(self, owners: Sequence[str], start: float, end: float) -> None:  # noqa: B027 - an optional hook
        """A batch of these owners' forwards ran from `start` to `end`."""


class AdaptivePolicy(BatchPolicy):
    """One batch in flight; when it returns, fire everything queued.

    The instances of the batch that just returned need a moment (guest code, host calls) to
    submit their next step; firing at the first arrival would split them into many small
    batches, so the policy waits for them: at first for half the last batch's time (at most
    `max_grace_s`), and for as long after that as they keep coming back (each arrival allows
    `slack_s` more), never past `max_wait_s` after the batch. An instance that ends or blocks on
    something else is not waited for. Instances just launched are expected the same way, for
    `launch_grace_s` after the last launch (2 ms: launches that come together prefill together;
    the scheduler reports a launch only while nothing else is under way, so a newcomer never holds
    running forwards or loops). It used to be 50 ms, so that a whole burst prefilled together: its
    first instances then waited for its last, and all of them ended after the same last step,
    one after the other (a tail of ~25 ms at 64 instances). Joining the batches as they come,
    the ends spread over the last steps; `app` 64 at a 2 ms step 0.70 -> 0.79, at 10 ms 0.92 ->
    0.94, 256 at 10 ms 0.80 -> 0.82 (bench/host_scale.py and a burst script, same hour).
    Host-side generation loops are in every batch anyway and are never waited for.
    Every method is O(1): they run on the per-step path, with hundreds of instances.
    """

    name = "adaptive"

    def __init__(self, launch_grace_s: float = 0.002, max_grace_s: float = 0.02, slack_s: float = 0.002,
                 max_wait_s: float = 0.05) -> None:
        self.launch_grace_s = launch_grace_s
        self.max_grace_s = max_grace_s
        self.slack_s = slack_s
        self.max_wait_s = max_wait_s
        self._expect: set[str] = set()  # owners whose next forward is due soon
        self._until = 0.0  # stop waiting at this time (moved on by arrivals) ...
        self._cap = 0.0  # ... and never later than this

    def ready(self, queue: Sequence[ForwardFuture], now: float) -> bool:
        if self._expect and now >= min(self._until, self._cap):
            self._expect.clear()  # the rest are late: they join a later batch
        return not self._expect

    def wait_s(self, queue: Sequence[ForwardFuture], now: float) -> float | None:
        if not self._expect:
            return None
        return max(min(self._until, self._cap) - now, 0.0002)

    def launched(self, owner: str, now: float) -> None:
        self._expect.add(owner)
        self._until = max(self._until, now + self.launch_grace_s)
        self._cap = max(self._cap, now + self.launch_grace_s)

    def submitted(self, owner: str) -> None:
        if owner in self._expect:
            self._expect.discard(owner)
            if self._expect:
                self._until = max(self._until, time.perf_counter() + self.slack_s)

    def expects(self, owner: str) -> bool:
        return owner in self._expect

    def forget(self, owner: str) -> bool:
        if owner not in self._expect:
            return False
        self._expect.discard(owner)
        return True

    def batch_done(self, owners: Sequence[str], start: float, end: float) -> None:
        if not owners:
            return
        self._expect.update(owners)
        self._until = max(self._until, end + min(0.5 * (end - start), self.max_grace_s))
        self._cap = max(self._cap, end + self.max_wait_s)


class KOrTPolicy(BatchPolicy):
    """Fire when `k` forwards are queued or the oldest has waited `t_ms`."""

    name = "k-or-t"

    def __init__(self, k: int = 8, t_ms: float = 16.0) -> None:
        if k < 1 or t_ms < 0:
            raise ValueError(f"k-or-t needs k >= 1 and t_ms >= 0, got {k}, {t_ms}")
        self.k = k
        self.t_s = t_ms / 1000

    def ready(self, queue: Sequence[ForwardFuture], now: float) -> bool:
        return len(queue) >= self.k or now - queue[0].submitted >= self.t_s

    def wait_s(self, queue: Sequence[ForwardFuture], now: float) -> float | None:
        return max(self.t_s - (now - queue[0].submitted), 0.0005)


POLICIES: dict[str, type[BatchPolicy]] = {"adaptive": AdaptivePolicy, "k-or-t": KOrTPolicy}


def make_policy(name: str, k: int = 8, t_ms: float = 16.0, launch_grace_ms: float = 2.0) -> BatchPolicy:
    """The policy called `name` (a `HostConfig.policy` value); `launch_grace_ms`: the adaptive
    policy's `launch_grace_s`, in ms."""
    if name == "k-or-t":
        return KOrTPolicy(k, t_ms)
    if name == "adaptive":
        return AdaptivePolicy(launch_grace_s=launch_grace_ms / 1000)
    raise ValueError(f"unknown batching policy {name!r}: use one of {sorted(POLICIES)}")
