"""The host on engine processes (stand-in engines, the `misbehave` fixture inferlet): one engine,
two replicas (placement by load, exports stay within a replica), and faults (an engine killed
under running instances: those end with the reason, the others carry on, the engine comes back,
no page is lost)."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import Run, wait_for, wasm_bytes

from gpu_backend.engine.client import EngineSpec, start_engines
from host import Host, HostConfig

pytestmark = pytest.mark.build

PS, PAGES = 4, 32


def _host(tmp: Path, replicas: int) -> Host:
    engines = start_engines(EngineSpec(standin=True, page_size=PS, num_pages=PAGES, standin_delay_s=0.001), replicas)
    return Host(HostConfig(data_dir=tmp, prefix_cache="off"), engines=engines)


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, str]]:
    h = _host(tmp_path_factory.mktemp("one"), 1)
    yield h, h.compile(wasm_bytes("misbehave"))
    h.shutdown()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, str]]:
    h = _host(tmp_path_factory.mktemp("two"), 2)
    yield h, h.compile(wasm_bytes("misbehave"))
    h.shutdown()


def _holding(run: Run) -> None:
    """Wait for a `hog` instance's "holding" message (its pages are allocated)."""
    ev = run.events.get(timeout=30)
    assert (ev.event, ev.message) == ("message", "holding"), ev


def _replicas(h: Host) -> list[dict]:
    return h.stats()["engine"]["replicas"]


def test_embed_runs_on_an_engine_process(one: tuple[Host, str]) -> None:
    # WIT embed with the model in the engine process: an image's vectors (the stand-in's "tower": its
    # first three bytes as tokens) between text tokens, and a hidden-state pass, as in process
    # (tests/test_embed_host.py has the same numbers on the in-process stand-in)
    h, _ = one
    prog = h.compile(wasm_bytes("embedder"))
    end = Run(h, prog, ["image", "050607ff"]).finish(60)
    assert end.event == "completed", end.message
    assert json.loads(end.message) == {"hidden": [100.0, 6.0, 97 + 98 + 5 + 6 + 7 + 99 + 100, 1.0], "tokens": 7}
    end = Run(h, prog, ["slots"]).finish(60)
    assert (end.event, end.message) == ("completed", "3")
    wait_for(lambda: h.free_pages() == PAGES, what="every page free")


def test_inferlets_run_on_an_engine_process(one: tuple[Host, str]) -> None:
    h, prog = one
    runs = [Run(h, prog, ["generate", "6", "10", "11", "12"]) for _ in range(4)]
    for r in runs:  # the stand-in counts up from the last token
        assert (r.finish(60).event, r.end.message) == ("completed", "13 14 15 16 17 18")
    assert h.scheduler.stats.forwards > 0
    wait_for(lambda: h.free_pages() == PAGES, what="every page free")


def test_a_killed_engine_ends_its_instances_and_comes_back(one: tuple[Host, str]) -> None:
    h, prog = one
    victims = [Run(h, prog, ["sleep_forward"]) for _ in range(3)]
    wait_for(lambda: h.free_pages() == PAGES - 3, what="three instances holding a page")
    pid = _replicas(h)[0]["pid"]
    killed = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    for v in victims:
        end = v.finish(30)
        assert end.event in ("aborted", "exception") and "died (killed by SIGKILL)" in end.message, end
    assert time.monotonic() - killed < 5
    wait_for(lambda: h.free_pages() == PAGES, what="every page back")  # no page lost
    end = Run(h, prog, ["generate", "2", "40"]).finish(60)  # waits for the restarted engine if need be
    assert (end.event, end.message) == ("completed", "41 42")
    st = _replicas(h)[0]
    assert st["pid"] != pid and st["deaths"] == 1 and st["alive"]


def test_replicas_place_by_load_and_keep_their_own_pages(two: tuple[Host, str]) -> None:
    h, prog = two
    assert h.total_pages == 2 * PAGES
    hogs = [Run(h, prog, ["hog", "3"]) for _ in range(4)]
    for r in hogs:
        _holding(r)
    assert [r["instances"] for r in _replicas(h)] == [2, 2]
    assert [r["free_pages"] for r in _replicas(h)] == [PAGES - 6, PAGES - 6]
    outs = [Run(h, prog, ["generate", "3", "100"]) for _ in range(4)]
    assert all(o.finish(60).message == "101 102 103" for o in outs)
    for r in hogs:
        h.signal(r.id, "go")
        assert r.finish(30).message == "released"
    # (a stepping instance's unclaimed run-ahead step frees its pages when it has run, after the end)
    wait_for(lambda: h.free_pages() == 2 * PAGES, what="every page free")


def test_export_import_within_a_replica_and_a_clear_error_across(two: tuple[Host, str]) -> None:
    h, prog = two
    assert Run(h, prog, ["export", "shared-kv"]).finish(30).message == "exported"  # persistent
    owner = next(r for r, st in enumerate(_replicas(h)) if st["free_pages"] == PAGES - 1)
    # both replicas idle: the importer goes where more pages are free, the other replica
    msg = Run(h, prog, ["import", "shared-kv"]).finish(30).message
    assert msg == (f"error: export 'shared-kv' lives on engine replica {owner} and this instance runs on "
                   f"replica {1 - owner}: KV pages cannot be imported across replicas")
    hog = Run(h, prog, ["hog", "1"])  # lands on the other replica, so the next one lands on the owner's
    _holding(hog)
    assert Run(h, prog, ["import", "shared-kv"]).finish(30).message == "imported 1"
    assert Run(h, prog, ["export", "shared-kv"]).finish(30).message.startswith("error: export name 'shared-kv'")
    assert Run(h, prog, ["unexport", "shared-kv"]).finish(30).message == "unexported"
    h.signal(hog.id, "go")
    hog.finish(30)
    wait_for(lambda: h.free_pages() == 2 * PAGES, what="every page free")


def test_a_dead_replica_leaves_the_other_serving(two: tuple[Host, str]) -> None:
    h, prog = two
    runs = [Run(h, prog, ["sleep_forward"]) for _ in range(4)]
    wait_for(lambda: h.free_pages() == 2 * PAGES - 4, what="four instances running")
    assert [r["instances"] for r in _replicas(h)] == [2, 2]
    on_zero = {r.id for r in runs if h._instances[r.id].pages.replica == 0}
    assert len(on_zero) == 2
    pid = _replicas(h)[0]["pid"]
    os.kill(pid, signal.SIGKILL)
    for r in runs:
        if r.id in on_zero:
            assert "died (killed by SIGKILL)" in r.finish(30).message
    survivors = [r for r in runs if r.id not in on_zero]
    time.sleep(0.5)  # the other replica's instances keep forwarding
    assert all(r.events.empty() for r in survivors) and h.free_pages() == 2 * PAGES - 2
    busy = h.stats()["scheduler"]["forwards"]  # (all replicas: the live one's forwards go on)
    time.sleep(0.2)
    assert h.stats()["scheduler"]["forwards"] > busy
    for r in survivors:
        h.terminate(r.id, "done")
        assert r.finish(30).event == "aborted"
    wait_for(lambda: _replicas(h)[0]["alive"] and _replicas(h)[0]["pid"] != pid, what="replica 0 restarted")
    wait_for(lambda: h.free_pages() == 2 * PAGES, what="every page free")
    outs = [Run(h, prog, ["generate", "1", "7"]) for _ in range(2)]
    assert [o.finish(60).message for o in outs] == ["8", "8"]
