"""The run gate: instance threads take turns instead of fighting over the GIL.

After a batch returns, every instance of the batch has to wake, convert its result, run its
guest (the SDK's loop, in wasm) and submit its next forward, while the scheduler waits for
them; this is the host's tax on every step. Woken all at once, 16 threads fight for the GIL:
Python passes it on at every ctypes call, each pass a futex wake and a context switch, on
caches the forward has just flushed. The gate lets `slots` instance threads run at a time (2:
one can run guest wasm, which needs no GIL, while the other runs host code) and hands the
wake-ups out in order, one per free slot, so that the scheduler thread finishing the batch and
the instances waking do not get in each other's way either. A thread gives its slot up
whenever it blocks, handing it to the longest waiting thread (threads waiting for a slot do
not poll). `bench/host_overhead.py` measures the tax with the gate on and off.

The gate never stops anyone for long: a thread waits for a slot only while the holders keep
moving. When the newest holder has held its slot longer than `max_hold_s` (a guest computing,
or sleeping in WASI where the host cannot see it) the others go ahead without it, a queued
wake-up goes out anyway, and the epoch callback makes a guest that runs that long give its
slot up; the epoch ticker polls the gate (`poll`), which lets the waiting threads go and sends
queued wake-ups out even then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["RunGate"]


class _Waiter:
    """A thread waiting in `enter`: its lock is released when a leaving thread hands it a slot."""

    __slots__ = ("lock", "granted")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()
        self.granted = False


class RunGate:
    """`slots` instance threads run at a time; each gives its slot up whenever it blocks."""

    def __init__(self, enabled: bool = True, slots: int = 2, max_hold_s: float = 0.02) -> None:
        if slots < 1:
            raise ValueError(f"the run gate needs at least one slot, got {slots}")
        self.enabled = enabled
        self.slots = slots
        self.max_hold_s = max_hold_s
        self._held = 0  # slots taken (guarded by _mutex)
        self._waiters: deque[_Waiter] = deque()  # threads waiting in enter() for a slot, in order
        self._since = 0.0  # when a slot was last taken
        self._mine = threading.local()
        self._mutex = threading.Lock()
        # Wake-ups of threads that will want a slot, handed out in order, one per free slot.
        self._pending: deque[Callable[[], bool]] = deque()
        self._handing = 0  # wake-ups sent whose thread has not taken its slot yet
        self._handed_at = 0.0

    # ---- wake-ups ----
    def wake(self, notify: Callable[[], bool]) -> None:
        """Call `notify` now if a slot is free, else once the threads ahead have had their turn.

        `notify` wakes a thread that will then take a slot, and returns whether a thread was
        waiting (if not, the next queued wake-up goes out at once)."""
        if not self.enabled:
            notify()
            return
        with self._mutex:
            self._pending.append(notify)
            if self._full():
                return  # it goes out when a slot frees (a batch's wake-ups queue up here)
        self._hand_on()

    def declined(self) -> None:
        """A thread woken by `wake` went back to waiting without taking a slot."""
        with self._mutex:
            self._handing = max(self._handing - 1, 0)
        if self._pending:
            self._hand_on()

    def poll(self) -> None:
        """Called every epoch tick: when the holders have stalled, the threads waiting for a slot go
        ahead without one and queued wake-ups go out."""
        if self._waiters:
            with self._mutex:
                passed = list(self._waiters) if self._stuck(time.perf_counter()) else []
                if passed:
                    self._waiters.clear()
            for waiter in passed:
                waiter.lock.release()  # not granted: it runs without a slot this time
        if self._pending:
            self._hand_on()

    def _stuck(self, now: float) -> bool:
        return now - max(self._since, self._handed_at) > self.max_hold_s

    def _full(self) -> bool:
        """No slot for another wake-up: all taken or promised, and the holders are moving (mutex held)."""
        return self._held + self._handing >= self.slots and not self._stuck(time.perf_counter())

    def _hand_on(self) -> None:
        """Send queued wake-ups while slots are free (or everyone ahead looks stuck)."""
        while True:
            with self._mutex:
                if not self._pending or self._full():
                    return
                notify = self._pending.popleft()
                self._handing += 1
                self._handed_at = time.perf_counter()
            if notify():
                return
            with self._mutex:  # nobody was waiting for it: the slot is still free
                self._handing = max(self._handing - 1, 0)

    # ---- slots ----
    def enter(self) -> None:
        """Take a slot (a thread that holds one keeps it); gives up when the holders are stuck.

        A thread that finds no free slot waits on a lock of its own and is handed the slot of the
        next thread that leaves, in arrival order. It does not poll: hundreds of parked threads
        waking every few ms to look cost more GIL time than the work they wait for (a burst of
        launches; waking every `max_hold_s` to look for stuck holders was ~700 wake-ups in a
        burst of 256). `poll` (the epoch ticker) lets the waiters go when the holders are stuck."""
        if not self.enabled or getattr(self._mine, "held", False):
            return
        now = time.perf_counter()
        with self._mutex:
            self._handing = max(self._handing - 1, 0)  # a wake-up handed to this thread has arrived
            if self._held < self.slots and not self._waiters:
                self._held += 1
                self._since = now
                got = True
            elif self._stuck(now):
                return  # run without a slot this time
            else:
                waiter = _Waiter()
                self._waiters.append(waiter)
                got = False
        if not got and not self._wait_for_slot(waiter):
            return
        self._mine.held = True
        self._mine.since = time.perf_counter()
        if self._pending:
            self._hand_on()  # a slot may still be free for the next one

    @staticmethod
    def _wait_for_slot(waiter: _Waiter) -> bool:
        """Block until a leaving thread hands `waiter` its slot (True) or `poll` finds the holders
        stuck (False)."""
        waiter.lock.acquire()
        return waiter.granted

    def leave(self) -> None:
        """Give this thread's slot up (if it holds one): to the longest waiting thread, if any, else
        it becomes free and the next queued wake-up goes out."""
        mine = self._mine
        if getattr(mine, "held", False):
            mine.held = False
            with self._mutex:
                if self._waiters:
                    waiter = self._waiters.popleft()
                    waiter.granted = True
                    self._since = time.perf_counter()
                    waiter.lock.release()
                else:
                    self._held -= 1
        if self._pending:
            self._hand_on()

    def leave_if_long(self) -> None:
        """Give the slot up if this thread has run for longer than `max_hold_s` since taking it."""
        mine = self._mine
        if getattr(mine, "held", False) and time.perf_counter() - mine.since > self.max_hold_s:
            self.leave()

    def held(self) -> bool:
        return bool(getattr(self._mine, "held", False))
