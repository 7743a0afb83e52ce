"""Warm instances: started ahead of demand, handed out at launch.

Starting a componentize-py instance costs a few ms of CPU before its first host call (a store,
instantiating ~14 core modules, the guest's entry glue), and a burst of launches pays it in
series: that start-up, not the per-token work, is what kept a burst of `text_completion`
instances from filling the backend's batches (docs/architecture.md, bench/host_scale.py). A
`WarmPool` keeps, for the programs launched most recently, up to `per_program` instances that
have already done that work and wait at their first host call (`Instance.warm`); `take` hands one
out and a background thread makes the next.

Invariants: a warm instance has received nothing from the host, so handing one out is
indistinguishable, to its guest, from a cold start. A program whose warm instance ends before its
first host call (it traps, returns without a call, or runs past `Instance.WARM_DEADLINE_S`) is
never warmed again: its launches start cold and meet the same fate in front of their client. At
most one warm instance is being started at a time, so warming never takes more than one core.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from host.wasm.instance import Instance

__all__ = ["WarmPool"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 10.0  # a warm instance not at its first call by then is given up on
# Refilling waits until launches have paused this long: during a burst the CPU is better spent
# running the instances just launched than starting the next ones.
QUIET_S = 0.05


class WarmPool:
    """Up to `per_program` parked instances for each of the `max_programs` most recent programs.

    `make(program)` returns a new, not yet started, warm `Instance`."""

    def __init__(self, make: Callable[[str], Instance], per_program: int, max_programs: int = 4) -> None:
        if per_program < 0 or max_programs < 1:
            raise ValueError(f"warm pool sizes must be >= 0 / >= 1, got {per_program}, {max_programs}")
        self._make = make
        self.per_program = per_program
        self.max_programs = max_programs
        self._ready: OrderedDict[str, deque[Instance]] = OrderedDict()  # least recently launched first
        self._target: dict[str, int] = {}
        self._cold: set[str] = set()  # programs that cannot be warmed
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._last_take = 0.0

    def take(self, program: str) -> Instance | None:
        """A parked instance of `program` (None if none is ready); the pool then makes the next."""
        if self.per_program == 0 and program not in self._target:
            return None
        with self._cond:
            if self._closed or program in self._cold:
                return None
            ready = self._ready.setdefault(program, deque())
            self._ready.move_to_end(program)
            self._target.setdefault(program, self.per_program)
            inst = None
            while ready and inst is None:
                cand = ready.popleft()
                inst = None if cand.finished.is_set() else cand
            self._last_take = time.monotonic()
            self._evict_old_programs()
            self._start_warmer()
            self._cond.notify_all()
        return inst

    def prewarm(self, program: str, n: int, timeout_s: float = 60.0) -> int:
        """Keep `n` instances of `program` warm from now on; wait until they are (or timeout).
        Returns how many are ready. n = 0 stops warming it and stops its parked instances."""
        if n == 0:
            with self._cond:
                self._target.pop(program, None)
                dropped = self._ready.pop(program, deque())
            for inst in dropped:
                inst.terminate("warm instance no longer needed")
            return 0
        with self._cond:
            self._target[program] = n
            self._ready.setdefault(program, deque())
            self._ready.move_to_end(program)
            self._start_warmer()
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._closed or program in self._cold
                                or len(self._ready[program]) >= n, timeout_s)
            return len(self._ready.get(program, ()))

    def ready_count(self, program: str) -> int:
        with self._cond:
            return len(self._ready.get(program, ()))

    def close(self) -> list[Instance]:
        """Stop warming; terminate and return the parked instances (the caller may join them)."""
        with self._cond:
            self._closed = True
            parked = [i for q in self._ready.values() for i in q]
            self._ready.clear()
            self._cond.notify_all()
        for inst in parked:
            inst.terminate("host shutting down")
        return parked

    # ---- the warmer thread ----
    def _start_warmer(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pie-warm", daemon=True)
            self._thread.start()

    def _evict_old_programs(self) -> None:
        """Keep the most recent `max_programs` programs warm (called with the lock held)."""
        while len(self._ready) > self.max_programs:
            program, old = self._ready.popitem(last=False)
            self._target.pop(program, None)
            for inst in old:
                inst.terminate("warm instance no longer needed")

    def _next_program(self) -> str | None:
        for program, ready in reversed(self._ready.items()):  # most recently launched first
            if program not in self._cold and len(ready) < self._target.get(program, 0):
                return program
        return None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or self._next_program() is not None)
                if self._closed:
                    return
                program = self._next_program()
                quiet = self._last_take + QUIET_S - time.monotonic()
            if quiet > 0:
                time.sleep(quiet)
                continue
            assert program is not None
            self._warm_one(program)

    def _warm_one(self, program: str) -> None:
        try:
            inst = self._make(program)
            inst.start()
        except Exception:  # e.g. the program was removed: stop warming it, launches will say why
            log.exception("could not start a warm instance of %s", program[:12])
            with self._cond:
                self._cold.add(program)
            return
        with inst.cond:
            inst.cond.wait_for(lambda: inst.at_first_call or inst.finished.is_set(), _START_TIMEOUT_S)
        with self._cond:
            if not inst.at_first_call or inst.finished.is_set():
                log.info("program %s is not warmed: its instance ended or stalled before its first host call",
                         program[:12])
                self._cold.add(program)
                inst.terminate("warm start failed")
            elif self._closed or program not in self._ready:
                inst.terminate("warm instance no longer needed")
            else:
                self._ready[program].append(inst)
                self._cond.notify_all()
