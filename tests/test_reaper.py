"""The store reaper: frees stores while the backend is idle, and has the ending thread free its own
store when it is behind (host/wasm/reaper.py)."""

from __future__ import annotations

import threading
import time

import pytest

from host.wasm.reaper import StoreReaper


class FakeStore:
    """Records when and on which thread it was closed."""

    def __init__(self) -> None:
        self.closed_by: threading.Thread | None = None
        self.closed = threading.Event()

    def close(self) -> None:
        assert not self.closed.is_set(), "a store freed twice"
        self.closed_by = threading.current_thread()
        self.closed.set()


@pytest.fixture
def busy():
    """The backend's state as the reaper sees it: busy until the test says otherwise."""
    state = {"busy": True}
    yield state
    state["busy"] = False


def make(busy: dict, **kw) -> StoreReaper:
    return StoreReaper(lambda: busy["busy"], **kw)


def test_a_store_waits_while_the_backend_is_busy_and_is_freed_on_the_reaper_thread_when_idle(busy):
    reaper = make(busy, max_delay_s=60.0, poll_s=0.005)
    try:
        store = FakeStore()
        reaper.put(store)
        time.sleep(0.05)
        assert not store.closed.is_set() and reaper.pending() == 1
        busy["busy"] = False
        assert store.closed.wait(2.0)
        assert store.closed_by is not threading.current_thread() and store.closed_by.name == "pie-reaper"
        assert reaper.freed_inline == 0
    finally:
        reaper.close()


def test_a_store_is_freed_after_max_delay_even_while_busy(busy):
    reaper = make(busy, max_delay_s=0.05, poll_s=0.005)
    try:
        store = FakeStore()
        reaper.put(store)
        assert store.closed.wait(2.0)
        assert store.closed_by.name == "pie-reaper"
    finally:
        reaper.close()


def test_behind_by_count_the_caller_frees_its_own_store(busy):
    reaper = make(busy, max_pending=2, max_delay_s=60.0, poll_s=0.005)
    try:
        queued = [FakeStore(), FakeStore()]
        for s in queued:
            reaper.put(s)
        extra = FakeStore()
        reaper.put(extra)
        # freed before put returned, by the calling thread; the queued ones still wait
        assert extra.closed.is_set() and extra.closed_by is threading.current_thread()
        assert reaper.pending() == 2 and not any(s.closed.is_set() for s in queued)
        assert reaper.freed_inline == 1
    finally:
        reaper.close()
    assert all(s.closed.is_set() for s in queued)  # close frees what is still queued


def test_behind_by_age_the_caller_frees_its_own_store(busy):
    reaper = make(busy, max_delay_s=0.2, poll_s=0.005)
    hold = threading.Lock()
    try:
        old = FakeStore()
        reaper.put(old)
        with hold:
            # make the reaper's thread slow: its first free blocks until we let it go
            blocked = threading.Event()
            orig_close = old.close

            def slow_close() -> None:
                blocked.set()
                with hold:
                    pass
                orig_close()

            old.close = slow_close  # type: ignore[method-assign]
            assert blocked.wait(2.0)  # the reaper took `old` when it was due (0.2 s) and is stuck in it
            second = FakeStore()
            reaper.put(second)  # queued: the queue was empty again
            time.sleep(0.25)  # `second` is now past max_delay_s and the reaper is still stuck
            third = FakeStore()
            reaper.put(third)
            assert third.closed.is_set() and third.closed_by is threading.current_thread()
            assert not second.closed.is_set()
    finally:
        reaper.close()


def test_without_free_when_behind_every_store_is_queued(busy):
    reaper = make(busy, max_pending=1, max_delay_s=60.0, poll_s=0.005)
    reaper.free_when_behind = False
    try:
        stores = [FakeStore() for _ in range(3)]
        for s in stores:
            reaper.put(s)
        assert reaper.freed_inline == 0
        assert all(s.closed_by is None or s.closed_by.name == "pie-reaper" for s in stores)
    finally:
        reaper.close()


def test_a_closed_reaper_frees_at_once(busy):
    reaper = make(busy)
    reaper.close()
    store = FakeStore()
    reaper.put(store)
    assert store.closed.is_set() and store.closed_by is threading.current_thread()


def test_wait_drained_returns_once_every_queued_store_is_freed(busy):
    reaper = make(busy, max_delay_s=60.0, poll_s=0.005)
    try:
        stores = [FakeStore() for _ in range(3)]
        for store in stores:
            reaper.put(store)
        assert not reaper.wait_drained(0.05)  # busy: they wait
        busy["busy"] = False
        assert reaper.wait_drained(5)
        assert all(s.closed.is_set() for s in stores)
    finally:
        reaper.close()
