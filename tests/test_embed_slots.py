"""Embedding slots (WIT 0.5.0 `embed`) held against each instance's limits, and a guest misusing
slots trapped alone: called the way a guest calls them (the registered import functions on a thread
bound to an instance, as tests/test_wit_fuzz.py does), on the stand-in backend (hidden size 4: a
text slot of n tokens is n vectors of 16 bytes; its hidden state is [token, position, sum of the
tokens attended to, 1])."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import wasmtime
from wasmtime.component import Record

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.api import import_tables
from host.cli.options import host_config_from_args
from host.cli.serve import parse_args
from host.wasm.calling import calling
from host.wasm.instance import Instance

Flat = dict[str, Callable[..., Any]]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, Flat]]:
    config = HostConfig(data_dir=tmp_path_factory.mktemp("slots"), max_embedding_slots=3, max_embedding_bytes=64)
    host = Host(config, backend=StandInBackend(page_size=4, num_pages=16))
    flat = {f"{iface}.{name}": fn for iface, table in import_tables(host.services).items() for name, fn in table.items()}
    yield host, flat
    host.shutdown()


def _instance(host: Host) -> Instance:
    """An instance (not started: the test thread plays its guest)."""
    return Instance(host._env, "0" * 64, ["slots"], lambda ev: None)


def _as(inst: Instance | None) -> None:
    calling.instance = inst


def _pooling(name: str) -> Record:
    class Pooling(Record):
        pass

    p = Pooling()
    p.name = name  # (wasmtime-py hands an enum case over by its name)
    return p


def test_slots_count_against_the_instances_limits(rig: tuple[Host, Flat]) -> None:
    host, flat = rig
    a, b = _instance(host), _instance(host)
    try:
        _as(a)
        s1 = flat["embed.embed-text"](None, [1, 2])  # 32 bytes
        s2 = flat["embed.embed-text"](None, [3])  # 48
        assert isinstance(s1, int) and isinstance(s2, int) and s1 != s2
        over = flat["embed.embed-text"](None, [4, 5])  # 80 > 64: an error result, not a trap
        assert isinstance(over, str) and "80 bytes, over its 64" in over and "--max-embedding-mb" in over
        assert isinstance(flat["embed.embed-text"](None, [4]), int)  # 64: at the bound
        full = flat["embed.embed-text"](None, [6])
        assert isinstance(full, str) and "maximum of 3 embedding slots" in full and "--max-embedding-slots" in full
        assert host.services.slots.held(a) == 3
        # another instance's limits are its own
        _as(b)
        assert isinstance(flat["embed.embed-text"](None, [7, 8, 9]), int)
        assert host.services.slots.held(b) == 1
        # released, a slot's room is free again
        _as(a)
        flat["embed.release"](None, [s1])
        assert isinstance(flat["embed.embed-text"](None, [10, 11]), int)
    finally:
        _as(None)
        host._instance_ended(a)
        host._instance_ended(b)
    assert host.services.slots.held(a) == host.services.slots.held(b) == 0  # ended: their slots went


@pytest.mark.parametrize(("call", "args", "match"), [
    ("embed.release", ([99],), "unknown embedding slot 99"),
    ("embed.slot-len", (1,), "unknown embedding slot 1"),  # the bystander's handle, never made here
    ("embed.hidden", ([0], 3, [1, 2, 3], [0, 1, 2], [(0, 1)], "last", False), "unknown embedding slot 1"),
    ("embed.embed-text", ([10**6],), "outside the vocabulary"),
    ("embed.embed-text", ([],), "embed-text of no tokens"),
])
def test_a_guest_misusing_slots_traps_alone(rig: tuple[Host, Flat], call: str, args: tuple[Any, ...],
                                            match: str) -> None:
    host, flat = rig
    bystander, bad = _instance(host), _instance(host)
    free = host.free_pages()
    try:
        _as(bystander)
        slot = flat["embed.embed-text"](None, [65, 66])
        assert slot == 1
        _as(bad)
        args = tuple(_pooling(a) if a in ("last", "mean") else a for a in args)
        if call == "embed.hidden":  # a pass over pages the bad instance does hold: only the slot is wrong
            args = (flat["kv.allocate"](None, 1), *args[1:])
        with pytest.raises(wasmtime.WasmtimeError, match=match) as e:
            flat[call](None, *args)
        assert str(e.value).startswith(f"{call}: ")
        _as(None)
        host._instance_ended(bad)  # what the host does to a trapped instance
        # the bystander's slot, and a pass with it, are untouched: "AB" then the slot's "AB" as vectors
        _as(bystander)
        assert flat["embed.slot-len"](None, slot) == 2
        pages = flat["kv.allocate"](None, 1)
        got = flat["embed.hidden"](None, pages, 4, [67, 68, 0, 0], [0, 1, 2, 3], [(2, slot)], _pooling("last"), False)
        np.testing.assert_array_equal(got, [66.0, 3.0, 67 + 68 + 65 + 66, 1.0])
    finally:
        _as(None)
        host._instance_ended(bystander)
        host._instance_ended(bad)
    assert host.free_pages() == free


def test_limits_from_the_flags_and_checked() -> None:
    cfg = host_config_from_args(parse_args(["--max-embedding-slots", "5", "--max-embedding-mb", "1.5"]))
    assert (cfg.max_embedding_slots, cfg.max_embedding_bytes) == (5, 3 * 2**20 // 2)
    default = host_config_from_args(parse_args([]))
    assert (default.max_embedding_slots, default.max_embedding_bytes) == (256, 256 * 2**20)
    with pytest.raises(ValueError, match="max_embedding_slots and max_embedding_bytes must be >= 1"):
        HostConfig(max_embedding_slots=0)
