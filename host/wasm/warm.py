"""Warm instances: started ahead of demand, handed out at launch.

Starting a componentize-py instance costs a few ms of CPU before its first host call (a store,
instantiating ~14 core modules, the guest's entry glue), and a burst of launches pays it in
series: that start-up, not the per-token work, is what kept a burst of `text_completion`
instances from filling the backend's batches (docs/architecture.md, bench/host_scale.py). A
`WarmPool` keeps, for the programs launched most recently, up to `per_program` instances that
have already done that work and wait at their first host call (`Instance.warm`); `take` hands one
out and a background thread makes the next.

How many: `per_program` is a fixed floor; with `auto` > 0 (the host's default) the pool also
follows demand: it keeps as many instances of a program warm as that program has had running at
once (its peak since it became one of the recent programs), never more than `auto` parked in all.
A host that has just served a burst of N requests of a program is thus ready for the next burst
of N (bench/host_scale.py measures what that buys: the burst skips N instance start-ups).

When warming happens: after launches and ends have paused for `QUIET_S` (refills during a
burst's ends made its tail 1.5-3x longer), and once the reaper has freed the finished instances'
stores unless pool slots used before are free (`reaping`: a warm instance takes a slot whose
memory is already faulted in, not one never used). In the background (`background=True`, where host/wasm/priority.py can lower a
thread, the host's default `HostConfig.warm_yield`) that is all: each warm instance's thread runs
at the lowest CPU priority until its launch, so the pool refills with the CPU
a running burst leaves (a 10 ms GPU step leaves most of it) and the next burst, launched right
after, finds it full. Otherwise (the rule before) the host must also be idle: no forward queued or
running, no launched instance alive; a host serving bursts back to back then never refills.
The `on_full` hook (the host's full collection, which stops every thread) waits for an idle host
either way.

Invariants: a warm instance has received nothing from the host but the model's constants (imports
declared `before_launch`, host/api/guest.py: the same answer for every launch, tenant and
replica), so handing one out is indistinguishable, to its guest, from a cold start. A program whose warm instance ends before its
first host call (it traps, returns without a call, or computes past `Instance.WARM_DEADLINE_S` of
CPU time) is never warmed again: its launches start cold and meet the same fate in front of their
client. One that is only slow to get there (its thread starved of CPU while a burst runs) or that
ended for the host's reasons (the instance pool full) is given up and warmed again later. At
most `warmers` warm instances are being started at a time (the host: one per four cores, at least
one, times its worker processes: a worker's warm start is a round trip the host's warmer waits
through, and each worker starts its own), so warming takes no more cores than that (`prime`, at
a host's start, runs its n at once).
`seed` gives a program a target as if it had run that many at once (a fresh host's standard
inferlets, `Host.warm_start`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from host.wasm.instance import Instance
from host.wasm.starts import START_MAX_WAIT_S, START_POLL_S

__all__ = ["WarmPool"]

log = logging.getLogger(__name__)

PRIME_FACTOR = 2  # `ready` primes this many slots per parked instance
_START_TIMEOUT_S = 10.0  # a warm instance not at its first call by then is given up on (and tried again)
_RETRY_S = 0.5  # how long a warmer waits after giving a start up
# Refilling waits until launches and ends have paused this long (and, unless it runs in the
# background, until the backend has no work): while a burst starts, its own starts come first.
QUIET_S = 0.05


class WarmPool:
    """Up to `per_program` parked instances for each of the `max_programs` most recent programs.

    `make(program)` returns a new, not yet started, warm `Instance`; `auto` caps the instances
    kept for demand (0 = only `per_program`). `busy`: the host has work; `reaping`: finished
    stores wait to be freed; `background`: refill while the host is busy, at the lowest priority;
    `ramping`: launched instances are starting (refills wait for them, up to `START_MAX_WAIT_S`);
    `warmers`: instances started at once (each on its own core: instantiation runs without the GIL)."""

    def __init__(self, make: Callable[[str], Instance], per_program: int, max_programs: int = 4,
                 auto: int = 0, busy: Callable[[], bool] | None = None,
                 on_full: Callable[[], None] | None = None, reaping: Callable[[], bool] | None = None,
                 background: bool = False, ramping: Callable[[], bool] | None = None,
                 warmers: int = 1) -> None:
        if warmers < 1:
            raise ValueError(f"the warm pool needs at least one warmer thread, got {warmers}")
        if per_program < 0 or max_programs < 1 or auto < 0:
            raise ValueError(f"warm pool sizes must be >= 0 / >= 1 / >= 0, got {per_program}, {max_programs}, {auto}")
        self._make = make
        self.per_program = per_program
        self.max_programs = max_programs
        self.auto = auto
        self._busy = busy or (lambda: False)
        self._reaping = reaping or (lambda: False)
        self._ramping = ramping or (lambda: False)
        self.background = background
        self._on_full = on_full  # called on the warmer thread when a refill has just completed
        self._ready: OrderedDict[str, deque[Instance]] = OrderedDict()  # least recently launched first
        self._target: dict[str, int] = {}
        self._pinned: set[str] = set()  # targets set by prewarm(): demand does not change them
        self._running: dict[str, int] = {}  # launched instances of each program not ended yet
        self._cold: set[str] = set()  # programs that cannot be warmed
        self._cond = threading.Condition()
        self._closed = False
        self.warmers = warmers
        self._threads: list[threading.Thread] = []
        self._starting: dict[str, int] = {}  # warm instances being started, by program
        self._owed = False  # the pool has refilled since `on_full` was last called
        self._last_activity = 0.0  # the last launch or end of a launched instance
        self.launches_warm = 0  # launches that a parked instance served, ever (`note_launch`)
        self.launches_cold = 0  # launches that started an instance of their own, ever

    def take(self, program: str) -> Instance | None:
        """A parked instance of `program` (None if none is ready); the pool then makes the next.
        Called for every launch: it counts the program's running instances (see `ended`)."""
        with self._cond:
            running = self._running[program] = self._running.get(program, 0) + 1
            if (self.per_program == 0 and self.auto == 0 and program not in self._target) or self._closed \
                    or program in self._cold:
                return None
            ready = self._ready.setdefault(program, deque())
            self._ready.move_to_end(program)
            if program not in self._pinned:
                want = max(self.per_program, min(running, self.auto), self._target.get(program, 0))
                self._target[program] = want
            inst = None
            while ready and inst is None:
                cand = ready.popleft()
                inst = None if cand.finished.is_set() else cand
            self._last_activity = time.monotonic()
            self._evict_old_programs()
            self._start_warmer()
            self._cond.notify_all()
        return inst

    def ended(self, program: str) -> None:
        """A launched instance of `program` has ended."""
        with self._cond:
            self._last_activity = time.monotonic()
            left = self._running.get(program, 0) - 1
            if left > 0:
                self._running[program] = left
            else:
                self._running.pop(program, None)

    def prewarm(self, program: str, n: int, timeout_s: float = 60.0) -> int:
        """Keep `n` instances of `program` warm from now on; wait until they are (or timeout).
        Returns how many are ready. n = 0 stops warming it and stops its parked instances."""
        if n == 0:
            with self._cond:
                self._target.pop(program, None)
                self._pinned.discard(program)
                dropped = self._ready.pop(program, deque())
            for inst in dropped:
                inst.terminate("warm instance no longer needed")
            return 0
        with self._cond:
            self._target[program] = n
            self._pinned.add(program)
            self._ready.setdefault(program, deque())
            self._ready.move_to_end(program)
            self._start_warmer()
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._closed or program in self._cold
                                or len(self._ready[program]) >= n, timeout_s)
            return len(self._ready.get(program, ()))

    def seed(self, program: str, n: int) -> None:
        """Keep `n` instances of `program` warm as if it had had n running at once: demand may
        raise the target later (unlike `prewarm`), and the program counts as launched just now."""
        with self._cond:
            if self._closed or n <= 0:
                return
            self._target[program] = max(self._target.get(program, 0), n)
            self._ready.setdefault(program, deque())
            self._ready.move_to_end(program)
            self._evict_old_programs()
            self._start_warmer()
            self._cond.notify_all()

    def prime(self, program: str, n: int, timeout_s: float = 60.0) -> None:
        """Start `n` instances of `program` at once, up to their first host call, and end them:
        each takes a pool slot and the slot's first reset happens now, not in a burst.

        Why: freeing a store resets its slot with a memset of up to `keep_resident_bytes`
        (host/wasm/pooling.py); the first time, every page of that range is faulted in (measured:
        ~8 ms of CPU for a `text_completion` slot used up to its first call, ~25 ms after a whole
        run, against ~0.9 ms once resident). Parked instances each hold a slot never used before, so
        a fresh host's bursts, back to back, paid those first resets at every burst's end, on the
        next burst's time (0.11-0.13 of the ideal at a 2 ms step vs 0.22 with cold starts that
        reused their slots). Primed, the slots are resident and the pool refills into them (the
        allocator gives a module the slots it last freed)."""
        insts = [self._make(program) for _ in range(n)]
        for inst in insts:
            inst.start()
        deadline = time.monotonic() + timeout_s
        for inst in insts:
            with inst.cond:
                inst.cond.wait_for(lambda i=inst: i.at_first_call or i.finished.is_set(),  # type: ignore[misc]
                                   max(deadline - time.monotonic(), 0.0))
        for inst in insts:
            inst.terminate("priming the instance pool")
        for inst in insts:
            inst.join(max(deadline - time.monotonic(), 0.0))

    def ready(self, programs: list[str], n: int, pool_slots: int | None,
              drain: Callable[[float], object] | None, timeout_s: float) -> None:
        """Keep `n` instances of each program warm, their pool slots primed first (`prime`: twice
        `n` as far as `pool_slots` hold them; `drain` waits for the primed stores' frees), and wait
        until they are ready or `timeout_s` (`Host.warm_start`).

        Twice `n` slots: the parked instances' and those the pool refills into while the first ones
        run. Primed once, a burst right after another still refilled into slots never used (each
        first reset ~25 ms of faults), and bursts of 256 back to back found the pool empty
        (bench/host_scale.py --back-to-back, 10 ms, same run: 0.625 / 0.683 vs 0.399 / 0.526 primed
        once, forward / overlapping backend). Each primed slot stays resident (~7-14 MB for a
        componentize-py guest)."""
        deadline = time.monotonic() + timeout_s
        primed = min(PRIME_FACTOR * n, max(n, pool_slots // (2 * max(len(programs), 1)))) if pool_slots is not None else n
        for program in programs:
            self.prime(program, primed, timeout_s)  # each slot's costly first reset now, not in a burst
            if drain is not None:  # (the resets are the frees of the primed stores)
                drain(max(deadline - time.monotonic(), 0.0))
            self.seed(program, n)
        for program in programs:
            self.wait_ready(program, n, max(deadline - time.monotonic(), 0.0))

    def note_launch(self, cold: bool) -> None:
        """Count a launch by how it started (the host's, once it knows: a parked instance it took may
        refuse the launch, and a queued or recorded launch never asks the pool)."""
        with self._cond:
            if cold:
                self.launches_cold += 1
            else:
                self.launches_warm += 1

    def as_dict(self) -> dict[str, int]:
        """Launches that found a parked instance and that started cold (ever), and the instances
        parked now (every program)."""
        with self._cond:
            parked = sum(1 for ready in self._ready.values() for inst in ready if not inst.finished.is_set())
            return {"launches_warm": self.launches_warm, "launches_cold": self.launches_cold, "parked": parked}

    def ready_count(self, program: str) -> int:
        with self._cond:
            return len(self._ready.get(program, ()))

    def wait_ready(self, program: str, n: int, timeout_s: float) -> int:
        """Wait until `n` instances of `program` are parked (or `timeout_s`); returns how many are."""
        with self._cond:
            self._cond.wait_for(lambda: self._closed or program in self._cold
                                or len(self._ready.get(program, ())) >= n, timeout_s)
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

    # ---- the warmer threads ----
    def _start_warmer(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name=f"pie-warm-{i}", daemon=True)
                             for i in range(self.warmers)]
            for t in self._threads:
                t.start()

    def _evict_old_programs(self) -> None:
        """Keep the most recent `max_programs` programs warm (called with the lock held)."""
        while len(self._ready) > self.max_programs:
            program, old = self._ready.popitem(last=False)
            self._target.pop(program, None)
            self._pinned.discard(program)
            for inst in old:
                inst.terminate("warm instance no longer needed")

    def _next_program(self) -> str | None:
        parked = sum(len(q) for q in self._ready.values()) + sum(self._starting.values())
        for program, ready in reversed(self._ready.items()):  # most recently launched first
            have = len(ready) + self._starting.get(program, 0)
            if program in self._cold or have >= self._target.get(program, 0):
                continue
            if program in self._pinned or have < self.per_program or parked < self.auto:
                return program
        return None

    def _run(self) -> None:
        # (These threads keep their priority: they mostly wait, and the instance threads they start
        # inherit it; each warm instance lowers its own, and is raised back to it at its launch.)
        ramp_since: float | None = None  # since when the next refill waits for starting instances
        while True:
            with self._cond:
                if self._closed:
                    return
                program = self._next_program()
                if program is None:
                    if not self._owed or self._on_full is None or self._starting:
                        self._owed = self._owed and bool(self._starting)
                        self._cond.wait_for(lambda: self._closed or self._next_program() is not None
                                            or (self._owed and not self._starting))
                        continue
                    # the hook's collection stops every thread: only once the host has been idle a while
                    if self._busy() or time.monotonic() - self._last_activity < QUIET_S:
                        self._cond.wait(QUIET_S)
                        continue
                    self._owed = False  # (one thread calls it)
                quiet = self._last_activity + QUIET_S - time.monotonic()
            if program is None:  # full, and the host idle: outside the lock, a `take` never waits for it
                try:
                    assert self._on_full is not None
                    self._on_full()
                except Exception:  # a broken hook must not stop the warming
                    log.exception("the warm pool's on_full hook failed")
                continue
            if quiet > 0 or self._reaping() or (not self.background and self._busy()):
                time.sleep(max(quiet, QUIET_S))
                continue
            if self._ramping():  # launched instances first, until each has queued its first forward
                now = time.monotonic()
                ramp_since = now if ramp_since is None else ramp_since
                if now - ramp_since < START_MAX_WAIT_S:
                    time.sleep(START_POLL_S)
                    continue
            with self._cond:
                if self._next_program() != program:  # another warmer took it meanwhile
                    continue
                self._starting[program] = self._starting.get(program, 0) + 1
            try:
                self._warm_one(program)
            finally:
                with self._cond:
                    left = self._starting[program] - 1
                    if left:
                        self._starting[program] = left
                    else:
                        del self._starting[program]
                    self._owed = True
                    self._cond.notify_all()
            ramp_since = None

    def _warm_one(self, program: str) -> None:
        given_up = False
        try:
            inst = self._make(program)
            inst.start()
        except Exception:  # e.g. the program was removed: stop warming it, launches will say why
            log.exception("could not start a warm instance of %s", program[:12])
            with self._cond:
                self._cold.add(program)
                self._cond.notify_all()  # (prewarm / wait_ready wait for this too)
            return
        with inst.cond:
            inst.cond.wait_for(lambda: inst.at_first_call or inst.finished.is_set(), _START_TIMEOUT_S)
        with self._cond:
            if inst.finished.is_set() and not inst.at_first_call and not inst.failed_in_host:
                # its guest returned, trapped or computed past Instance.WARM_DEADLINE_S first
                log.info("program %s is not warmed: its instance ended before its first host call", program[:12])
                self._cold.add(program)
                self._cond.notify_all()  # (prewarm / wait_ready wait for this too)
            elif not inst.at_first_call or inst.finished.is_set():
                # Not there yet: its thread, at the lowest priority, waits for a core (a burst runs;
                # its CPU time, not this wait, is what the instance's own deadline counts), or it
                # ended for the host's reasons (the instance pool full). The next refill tries again.
                log.info("a warm instance of %s was given up (%s); warming goes on", program[:12],
                         "it failed in the host" if inst.failed_in_host else "it ended" if inst.finished.is_set() else
                         f"not at its first host call after {_START_TIMEOUT_S:g} s")
                inst.terminate("warm start given up")
                given_up = True
            elif self._closed or program not in self._ready:
                inst.terminate("warm instance no longer needed")
            else:
                self._ready[program].append(inst)
                self._cond.notify_all()
        if given_up:  # (a host that keeps failing them is not retried in a tight loop)
            with self._cond:
                self._cond.wait_for(lambda: self._closed, _RETRY_S)
