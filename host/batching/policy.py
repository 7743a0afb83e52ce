"""Batching policies: when the scheduler fires the forwards it has queued.

A policy is consulted with the scheduler's lock held, so its methods must be quick and must
not block. Pie has the same cut (a `BatchPolicy` trait); see REFERENCE.md for its policies.
"""

from __future__ import annotations

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
    batches, so the policy waits until each has resubmitted (or ended, or blocked on something
    else), at most half the last batch's time (<= `max_grace_s`). Instances just launched are
    expected the same way, up to `launch_grace_s`, so requests arriving together prefill together.
    """

    name = "adaptive"

    def __init__(self, launch_grace_s: float = 0.05, max_grace_s: float = 0.02) -> None:
        self.launch_grace_s = launch_grace_s
        self.max_grace_s = max_grace_s
        self._expect: dict[str, float] = {}  # owner -> time after which it is not waited for

    def ready(self, queue: Sequence[ForwardFuture], now: float) -> bool:
        if self._expect:
            self._expect = {o: t for o, t in self._expect.items() if t > now}
        return not self._expect

    def wait_s(self, queue: Sequence[ForwardFuture], now: float) -> float | None:
        if not self._expect:
            return None
        return max(min(self._expect.values()) - now, 0.0002)

    def launched(self, owner: str, now: float) -> None:
        self._expect[owner] = now + self.launch_grace_s

    def submitted(self, owner: str) -> None:
        self._expect.pop(owner, None)

    def expects(self, owner: str) -> bool:
        return owner in self._expect

    def forget(self, owner: str) -> bool:
        return self._expect.pop(owner, None) is not None

    def batch_done(self, owners: Sequence[str], start: float, end: float) -> None:
        until = end + min(0.5 * (end - start), self.max_grace_s)
        for o in owners:
            self._expect[o] = max(self._expect.get(o, 0.0), until)


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


def make_policy(name: str, k: int = 8, t_ms: float = 16.0) -> BatchPolicy:
    """The policy called `name` (a `HostConfig.policy` value)."""
    if name == "k-or-t":
        return KOrTPolicy(k, t_ms)
    if name == "adaptive":
        return AdaptivePolicy()
    raise ValueError(f"unknown batching policy {name!r}: use one of {sorted(POLICIES)}")
