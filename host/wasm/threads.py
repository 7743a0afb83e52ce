"""The threads that run instances, kept for the next instance instead of ending with each one.

Why: an instance's guest runs on a thread of its own (it blocks in its host calls), and a new
thread per instance cost more than its creation: each new thread's stack, CPython frame stack,
signal stack and wasmtime's per-thread state are fresh mappings whose pages fault in again, and
each thread's end unmaps them (a TLB shootdown across the process's cores). In a worker process's
closed loop of short completions that was about a quarter of its page faults and a few percent of
its CPU (bench/host_scale_b2b_workers.md). A thread here runs one instance's `_main` at a time; when
it returns, the thread waits for the next (newest first, its pages still resident) and ends after
`IDLE_S` without one, so an idle host holds no threads for a burst long gone.

Invariants: a job runs on a thread at the nice value that thread had when it was made (an instance
that lowered its own thread and ended before raising it again: the thread is raised back, or ends if
it may not be); the thread's name is the job's while it runs; `Job.done` is set once its function
has returned (or raised: that is logged, and the thread goes on).

`PIE_IDLE_THREADS=0` in the environment (the host's and so its workers') keeps no thread: each
instance has a thread of its own again, as before; for A/B runs (bench/workers.py --idle-threads).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["IDLE_S", "MAX_IDLE", "Job", "Threads", "run"]

log = logging.getLogger(__name__)

IDLE_S = 30.0  # a thread with no instance to run for this long ends


def _max_idle(default: int = 256) -> int:
    """At most this many threads wait for an instance; more end with theirs (`PIE_IDLE_THREADS`)."""
    raw = os.environ.get("PIE_IDLE_THREADS", "")
    try:
        return max(int(raw), 0) if raw else default
    except ValueError:
        log.warning("PIE_IDLE_THREADS=%r is not a number: keeping up to %d idle instance threads", raw, default)
        return default


MAX_IDLE = _max_idle()


class Job:
    """One function run on a pooled thread: `done` once it has returned."""

    __slots__ = ("fn", "name", "done", "native_id")

    def __init__(self, fn: Callable[[], None], name: str) -> None:
        self.fn: Callable[[], None] | None = fn  # (dropped once run: an instance's `_main` refers back to it)
        self.name = name
        self.done = threading.Event()
        self.native_id = 0  # the thread's id while it runs (for setpriority), set before `fn` runs

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the function has returned; True if it has."""
        return self.done.wait(timeout)


class _Runner:
    __slots__ = ("jobs", "nice")

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self.nice: int | None = None


class Threads:
    """A pool of threads that grows with the jobs running at once (a job may block for as long as
    it likes: every job gets a thread at once) and keeps up to `max_idle` for `idle_s` after."""

    def __init__(self, max_idle: int = MAX_IDLE, idle_s: float = IDLE_S) -> None:
        self.max_idle, self.idle_s = max_idle, idle_s
        self._lock = threading.Lock()
        self._idle: list[_Runner] = []  # waiting for a job; the last one idled most recently

    def run(self, fn: Callable[[], None], name: str) -> Job:
        """Run `fn` on an idle thread, or on a new one (which, like `Thread.start`, returns once it
        runs: RuntimeError if no thread can be made)."""
        job = Job(fn, name)
        with self._lock:
            runner = self._idle.pop() if self._idle else None
        if runner is not None:
            runner.jobs.put(job)
            return job
        runner = _Runner()
        runner.jobs.put(job)
        threading.Thread(target=self._serve, args=(runner,), name=name, daemon=True).start()
        return job

    def idle_count(self) -> int:
        """Threads waiting for a job now."""
        with self._lock:
            return len(self._idle)

    def _serve(self, runner: _Runner) -> None:
        me = threading.current_thread()
        tid = threading.get_native_id()
        try:
            runner.nice = os.getpriority(os.PRIO_PROCESS, tid)
        except (OSError, AttributeError):
            runner.nice = None
        job = runner.jobs.get()
        while True:
            me.name = job.name
            job.native_id = tid
            try:
                if job.fn is not None:
                    job.fn()
            except BaseException:  # (Instance._main handles its own; a thread here must not die of one)
                log.exception("%s failed", job.name)
            finally:
                job.fn = None
                job.done.set()
            del job
            if not _reset(runner, tid):
                return
            me.name = "pie-idle"
            with self._lock:
                if len(self._idle) >= self.max_idle:
                    return
                self._idle.append(runner)
            try:
                job = runner.jobs.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if runner in self._idle:  # (else `run` took it just now: its job is on the way)
                        self._idle.remove(runner)
                        return
                job = runner.jobs.get()


def _reset(runner: _Runner, tid: int) -> bool:
    """The thread's nice value back to what it was made with; False if that is not allowed."""
    if runner.nice is None:
        return True
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) != runner.nice:
            os.setpriority(os.PRIO_PROCESS, tid, runner.nice)
    except OSError:
        return False
    return True


_threads = Threads()  # the process's: every host and worker here shares it
run = _threads.run
