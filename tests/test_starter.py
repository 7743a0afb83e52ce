"""Cold launches start their threads on the starter's thread (host/wasm/starter.py), so `launch`
never waits for a GIL hand-over; a queued instance can be joined, terminated and fail to start.
Runs on the fake backend (the token after t is t+1), so the expected outputs are known."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakes import FakeBackend
from helpers import Run, wasm_bytes

from host import Host, HostConfig
from host.wasm.instance import Instance
from host.workers.remote import RemoteInstance

StartFn = Callable[[Instance], None]


def patch_start(monkeypatch: pytest.MonkeyPatch, wrap: Callable[[StartFn], StartFn]) -> None:
    """Replace `start` with `wrap(start)` in Instance and in RemoteInstance (which has its own:
    with --workers, a cold launch is placed on its worker from the starter's thread)."""
    for cls in (Instance, RemoteInstance):
        monkeypatch.setattr(cls, "start", wrap(cls.start))


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    h = Host(HostConfig(warm_auto=0, data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=256))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def misbehave_wasm() -> bytes:
    return wasm_bytes("misbehave")


def test_a_cold_launch_starts_its_thread_on_the_starter_not_the_launching_thread(
        host: Host, misbehave_wasm: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    program = host.compile(misbehave_wasm)
    starters: list[str] = []

    def recording(start: StartFn) -> StartFn:
        def recording_start(self: Instance) -> None:
            starters.append(threading.current_thread().name)
            start(self)
        return recording_start

    patch_start(monkeypatch, recording)
    runs = [Run(host, program, ["generate", "3", str(k)]) for k in range(4)]
    assert [(r.finish(30).event, r.end.message) for r in runs] == \
        [("completed", f"{k + 1} {k + 2} {k + 3}") for k in range(4)]  # type: ignore[union-attr]
    assert len(starters) == 4 and all(name.startswith("pie-starter") for name in starters)


def test_a_queued_instance_can_be_joined_and_terminated_before_its_thread_starts(
        host: Host, misbehave_wasm: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    program = host.compile(misbehave_wasm)
    release = threading.Event()

    def held(start: StartFn) -> StartFn:
        def held_start(self: Instance) -> None:
            release.wait(10)
            start(self)
        return held_start

    patch_start(monkeypatch, held)
    run = Run(host, program, ["generate", "3", "1"])
    assert not host.wait(run.id, 0.05)  # not started yet: a join that times out, no error
    host.terminate(run.id)
    release.set()
    assert host.wait(run.id, 10)
    assert run.finish(10).event == "aborted"


def test_an_instance_whose_thread_cannot_start_ends_with_an_error_and_the_host_goes_on(
        host: Host, misbehave_wasm: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    program = host.compile(misbehave_wasm)

    def failing(_start: StartFn) -> StartFn:
        def failing_start(self: Instance) -> None:
            with self.cond:
                self._begin_start()  # counted as starting first, as the real start does
            raise RuntimeError("can't start new thread")
        return failing_start

    with monkeypatch.context() as m:
        patch_start(m, failing)
        failed = Run(host, program, ["generate", "3", "1"])
        end = failed.finish(10)
        assert end.event == "exception" and "could not start the instance's thread: can't start new thread" in end.message
        assert host.wait(failed.id, 1) and not host.starts.active()
    ok = Run(host, program, ["generate", "3", "5"])
    assert (ok.finish(30).event, ok.end.message) == ("completed", "6 7 8")  # type: ignore[union-attr]


def test_the_starter_thread_ends_with_the_host(tmp_path: Path, misbehave_wasm: bytes) -> None:
    h = Host(HostConfig(warm_auto=0, data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=256))
    program = h.compile(misbehave_wasm)
    run = Run(h, program, ["generate", "2", "0"])
    assert (run.finish(30).event, run.end.message) == ("completed", "1 2")  # type: ignore[union-attr]
    [thread] = h._starter._pool._threads
    assert thread.name.startswith("pie-starter") and thread.is_alive()
    h.shutdown()
    thread.join(5)
    assert not thread.is_alive()
