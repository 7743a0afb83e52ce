"""How an instance's thread blocks and is woken: `Waiter`, the base of `Instance`.

The thread blocked in `wait_until` (or a warm instance's `await_launch`) sleeps on `_kick`
(released = woken), not on `cond`: a Condition allocates a lock per wait and its waiter must take
`cond` back while the notifier still holds it; `_notify` (the per-token wake-up) and a launch
release the kick after letting go of `cond`. Other waiters on `cond` (the warm pool waiting for a
first call) still use it. A thread that blocks gives its run-gate slot up first and takes one
again when it goes on (host/batching/gate.py); the gate hands wake-ups out in turn (`wake`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from host.batching.future import ForwardFuture
    from host.batching.gate import RunGate

__all__ = ["Waiter"]


class Waiter:
    """The blocking waits and wake-ups of one instance thread; `Instance` supplies the hooks
    (`check_alive`, `budget_left_s`, `_blocking`)."""

    def __init__(self, gate: RunGate) -> None:
        self._gate = gate
        self.cond = threading.Condition()
        self._kick = threading.Lock()
        self._kick.acquire()
        self._waiting = False  # the thread is blocked on `_kick` (guarded by cond)
        self._handed = False  # the gate has woken it for its turn (guarded by cond)

    def check_alive(self) -> None:
        """Raise if the thread must stop waiting (the instance's `Terminated`)."""

    def budget_left_s(self) -> float | None:
        """Seconds left before the thread must stop waiting; None: no bound."""
        return None

    def _blocking(self) -> None:
        """The thread is about to block (outside cond)."""

    def wait_until(self, ready: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block (GIL released) until ready() or timeout; raises Terminated if stopped meanwhile.

        The wait also ends when the wall-clock budget runs out (then Terminated, with the budget
        reason), so a guest blocked in an import cannot outlive its budget. A thread that blocks
        gives its run-gate slot up first and takes one again when it goes on.
        """
        if ready():
            return True
        if timeout_s is not None and timeout_s <= 0:
            self.check_alive()
            return False
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        self._blocking()
        self._gate.leave()  # outside self.cond: the gate wakes other instances through theirs
        try:
            with self.cond:
                while not ready():
                    self.check_alive()
                    remaining = None if deadline is None else deadline - time.perf_counter()
                    if remaining is not None and remaining <= 0:
                        return False
                    remaining = _earliest(remaining, self.budget_left_s())
                    self._waiting = True
                    self.cond.release()
                    try:
                        self._kick.acquire(True, -1 if remaining is None else max(remaining, 0.0))
                    finally:
                        self.cond.acquire()
                    self._waiting = False  # a kick that came after a timeout stays: a spurious wake-up
                    if self._handed:  # the gate woke us for our turn
                        self._handed = False
                        if not ready():  # not ready after all: pass the turn on
                            self._outside_cond(self._gate.declined)
                return True
        finally:  # outside self.cond: the scheduler's wake-up callback needs it
            self._gate.enter()

    def _outside_cond(self, fn: Callable[[], None]) -> None:
        """Run `fn` with self.cond released: gate calls take other instances' conds."""
        self.cond.release()
        try:
            fn()
        finally:
            self.cond.acquire()

    def wait_for(self, fut: ForwardFuture, on_abort: Callable[[], None] | None = None) -> Any:
        """Block until a job this instance submitted is done and return its result (raising its error).
        `on_abort`: called if the wait ends otherwise (terminated, out of budget) before that is
        re-raised, e.g. to end a generation loop at its next step."""
        if not fut.done():  # (a done job needs no wake-up: a decode step's claimed prediction may be)
            fut.add_done_callback(self.wake)
            try:
                self.wait_until(fut.done)
            except BaseException:
                if on_abort is not None:
                    on_abort()
                raise
        return fut.wait()

    def wake(self, _fut: ForwardFuture | None = None) -> None:
        """Done-callback of this instance's forwards: wake its thread (in its turn, see RunGate); also
        called without one when what it waits for changed (host/suspend.py)."""
        self._gate.wake(self._notify)

    def _notify(self) -> bool:
        """The gate's wake-up: wake the thread if it waits; returns whether it was waiting."""
        with self.cond:
            if not self._waiting:
                return False
            self._waiting = False
            self._handed = True
        self._kick.release()  # outside cond, so the thread does not wake only to wait for it
        return True

    def _wake_all(self) -> None:
        """Something a waiter may be waiting for has changed (cond held): wake them all."""
        self.cond.notify_all()
        if self._waiting:
            self._waiting = False
            self._kick.release()


def _earliest(a: float | None, b: float | None) -> float | None:
    """The smaller of two optional timeouts (None = no limit)."""
    if a is None:
        return b
    return a if b is None else min(a, b)
