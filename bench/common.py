"""Shared by the bench scripts (imported as a sibling: run the scripts as `python bench/NAME.py`)."""

from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any

from host import Host, InstanceEvent
from host.cli.build import resolve_inferlet

ROOT = Path(__file__).resolve().parent.parent


class Run:
    """One instance's events, collected until its terminal event (`ended_at`: its perf_counter time)."""

    def __init__(self, host: Host, program: str, args: list[str]) -> None:
        self.events: queue.Queue[InstanceEvent] = queue.Queue()
        self.messages: list[str] = []
        self.ended_at = float("nan")
        self.id = host.launch(program, args, self._on_event)
        self.end: InstanceEvent | None = None

    def _on_event(self, ev: InstanceEvent) -> None:
        if ev.terminal:
            self.ended_at = time.perf_counter()
        self.events.put(ev)

    def finish(self, timeout: float = 300.0) -> InstanceEvent:
        while self.end is None:
            ev = self.events.get(timeout=timeout)
            if ev.terminal:
                self.end = ev
            else:
                self.messages.append(ev.message)
        return self.end


class BatchLog:
    """Every backend call from now on, as (start, end, batch size): the backend's `forward` (and
    `start_forward`, the overlapping way the host prefers: from the call to its `wait()`'s
    return) is wrapped to time it (a stand-in backend, whose calls are the GPU steps of the benches)."""

    def __init__(self, backend: Any) -> None:
        self.calls: list[tuple[float, float, int]] = []
        # (each call's start, the process's CPU time then: time.process_time), in the order of the starts
        self.cpu_at_start: list[tuple[float, float]] = []
        forward = backend.forward
        calls, cpu = self.calls, self.cpu_at_start
        inside = [0]  # the stand-in's forward is start_forward + wait: one call, logged once

        def timed(reqs: Any) -> Any:
            start = time.perf_counter()
            if not inside[0]:
                cpu.append((start, time.process_time()))
            inside[0] += 1
            try:
                return forward(reqs)
            finally:
                inside[0] -= 1
                calls.append((start, time.perf_counter(), len(reqs)))

        backend.forward = timed
        start_forward = getattr(backend, "start_forward", None)
        if start_forward is not None:
            def timed_start(reqs: Any, *args: Any) -> Any:  # (args: the torch backend's Feed)
                if inside[0]:
                    return start_forward(reqs, *args)
                start = time.perf_counter()
                cpu.append((start, time.process_time()))
                return _TimedStep(start_forward(reqs, *args), start, len(reqs), calls)

            backend.start_forward = timed_start

    def gaps_ms(self, t0: float = float("-inf"), t1: float = float("inf")) -> list[float]:
        """From each call's end to the next call's start, for the calls that start in [t0, t1]."""
        return [1000 * (b[0] - a[1]) for a, b in zip(self.calls, self.calls[1:], strict=False) if t0 <= a[0] <= t1]

    def periods_ms(self, n: int) -> list[float]:
        """Start-to-start periods between consecutive calls that both hold `n` requests (decode steps
        of all n loops: the steady state; calls may overlap)."""
        c = sorted(self.calls)
        return [1000 * (b[0] - a[0]) for a, b in zip(c, c[1:], strict=False) if a[2] == n and b[2] == n]


class _TimedStep:
    """A started batch, timed to its `wait()`; anything else (`tokens`, what a `Feed` reads) is the
    step's own."""

    def __init__(self, step: Any, start: float, size: int, calls: list[tuple[float, float, int]]) -> None:
        self._step, self._start, self._size, self._calls = step, start, size, calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self._step, name)

    def wait(self) -> Any:
        try:
            return self._step.wait()
        finally:
            self._calls.append((self._start, time.perf_counter(), self._size))


def compile_inferlet(host: Host, name_or_path: str | Path) -> str:
    """Build (cached) and compile a standard inferlet, a source folder or a .wasm; returns its hash."""
    return host.compile(resolve_inferlet(name_or_path, quiet=True).read_bytes())


def settle(host: Host, program: str, n: int, timeout_s: float = 120.0) -> None:
    """Let the host finish what it does after a burst before the next one is measured: the warm pool
    refills (to the n instances the program just ran at once, up to its `warm_auto`) and the reaper
    frees finished stores; both run while the host is idle (host/wasm/warm.py, host/wasm/reaper.py),
    so a long-running host has done them before its next burst.

    The pool learns n from a burst that had n instances running at once; a first, cold burst
    whose launches are slower than its instances' runs never had them all at once (the earliest
    end before the last start), so the pool is told n outright (`Host.prewarm`), as it would have
    learned from the next bursts."""
    want = min(n, host.warm.auto)
    if want and host.warm.wait_ready(program, want, 0.0) < want:
        host.prewarm(program, want, timeout_s)
    if host.warm.wait_ready(program, want, timeout_s) < want:
        raise RuntimeError(f"the warm pool did not refill to {want} instances in {timeout_s:g} s")
    reaper = host.wasm.reaper
    deadline = time.monotonic() + timeout_s
    while reaper is not None and reaper.pending() and time.monotonic() < deadline:
        time.sleep(0.05)
    # Instance workers (HostConfig.workers) free their guests' stores with reapers of their own, which
    # the host does not see: wait until the workers are idle (under 10% of a core over 0.2 s).
    pool = getattr(host, "workers", None)
    last = None
    while pool is not None and time.monotonic() < deadline:
        cpus = [w["cpu_s"] for w in pool.stats()]
        if any(c is None for c in cpus):
            break
        now = sum(cpus)
        if last is not None and now - last < 0.02:
            break
        last = now
        time.sleep(0.2)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-quantile (0 <= q <= 1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]
