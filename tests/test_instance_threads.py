"""host/wasm/threads.py: the threads that run instances are reused, never shared by two at once,
come back at the nice value they were made with, and end when idle."""

from __future__ import annotations

import os
import threading
import time
import weakref

import pytest

from host.wasm import priority, threads
from host.wasm.threads import Threads


def _ran(pool: Threads, fn, name: str = "job"):  # type: ignore[no-untyped-def]
    job = pool.run(fn, name)
    assert job.join(10)
    return job


def _wait_idle(pool: Threads, n: int) -> None:
    deadline = time.monotonic() + 10
    while pool.idle_count() != n:
        assert time.monotonic() < deadline, f"idle threads: {pool.idle_count()}, expected {n}"
        time.sleep(0.005)


def test_a_thread_runs_the_next_job_once_its_job_is_done() -> None:
    pool = Threads(max_idle=8)
    seen: list[tuple[int, str]] = []

    def record() -> None:
        seen.append((threading.get_native_id(), threading.current_thread().name))

    first = _ran(pool, record, "inferlet-a")
    _wait_idle(pool, 1)
    second = _ran(pool, record, "inferlet-b")
    assert seen[0][0] == seen[1][0] == first.native_id == second.native_id
    assert [name for _, name in seen] == ["inferlet-a", "inferlet-b"]  # named after the job it runs


def test_jobs_running_at_once_each_get_a_thread() -> None:
    """Every job may block until all the others run: none waits for a thread."""
    pool = Threads(max_idle=4)
    n = 24
    everyone = threading.Barrier(n, timeout=10)
    ids: list[int] = []
    jobs = [pool.run(lambda: (ids.append(threading.get_native_id()), everyone.wait()), f"j{i}") for i in range(n)]
    assert all(j.join(10) for j in jobs)
    assert len(set(ids)) == n
    _wait_idle(pool, 4)  # the rest ended with their jobs (max_idle)


def test_a_failing_job_is_done_and_its_thread_goes_on() -> None:
    pool = Threads(max_idle=2)

    def boom() -> None:
        raise RuntimeError("the job's own failure")

    first = _ran(pool, boom)
    assert first.done.is_set()
    _wait_idle(pool, 1)
    assert _ran(pool, lambda: None).native_id == first.native_id


def test_an_idle_thread_ends_after_idle_s() -> None:
    pool = Threads(max_idle=2, idle_s=0.05)
    job = _ran(pool, lambda: None)
    _wait_idle(pool, 0)
    alive = {t.native_id for t in threading.enumerate()}
    assert job.native_id not in alive
    assert _ran(pool, lambda: None).native_id != 0  # a new thread serves the next


def test_no_thread_kept_with_max_idle_zero() -> None:
    pool = Threads(max_idle=0)
    ids = {_ran(pool, threading.get_native_id).native_id for _ in range(3)}
    assert pool.idle_count() == 0 and len(ids) == 3


def test_a_thread_comes_back_at_its_own_nice_value() -> None:
    """An instance that lowered its thread (a warm one, host/wasm/priority.py) and ended before it
    was raised again leaves it lowered; the next instance on that thread must not run at nice 19."""
    pool = Threads(max_idle=2)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    lowered: list[int] = []
    first = _ran(pool, lambda: (priority.lower(), lowered.append(os.getpriority(os.PRIO_PROCESS, 0))))
    assert lowered == [priority.BACKGROUND_NICE]
    nice: list[int] = []
    if priority.available():  # raised back: the same thread runs the next job at its first value
        _wait_idle(pool, 1)
        second = _ran(pool, lambda: nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        assert second.native_id == first.native_id and nice == [base]
    else:  # it may not be raised: the thread ended instead of serving another job
        _wait_idle(pool, 0)
        second = _ran(pool, lambda: nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        assert second.native_id != first.native_id and nice == [base]


def test_a_job_lets_go_of_its_function_once_run() -> None:
    """An instance's `_main` refers to the instance, which keeps its job: the job drops the function
    when it has run, so an ended instance is freed by reference counting, not left to the collector."""
    pool = Threads(max_idle=2)

    class Owner:
        pass

    owner = Owner()
    ref = weakref.ref(owner)
    owner.job = pool.run(lambda o=owner: None, "cycle")  # type: ignore[attr-defined]
    assert owner.job.join(10)  # type: ignore[attr-defined]
    del owner
    assert ref() is None


def test_idle_cap_from_the_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PIE_IDLE_THREADS", "0")
    assert threads._max_idle() == 0
    monkeypatch.setenv("PIE_IDLE_THREADS", "many")
    assert threads._max_idle(7) == 7 and "PIE_IDLE_THREADS='many' is not a number" in caplog.text
    monkeypatch.delenv("PIE_IDLE_THREADS")
    assert threads._max_idle(7) == 7
