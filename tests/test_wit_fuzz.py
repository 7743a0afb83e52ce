"""Property tests of the whole WIT surface: hostile arguments to every import.

Each example is a short program of import calls with random and boundary arguments, made the way
a guest makes them (through the registered import functions, on a thread bound to an instance).
Every call must return, return a WIT error, or trap that instance with a message naming the call;
the host never crashes, never leaks a page, and a well-behaved co-runner's forward is unaffected.
This file runs on the stand-in backend with no wasm build, so `make test-fast` covers it; the
example count comes from PIE_FUZZ_EXAMPLES (40 by default, more in `make test`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import wasmtime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wasmtime.component import Record, ResourceHost

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.api import import_tables
from host.api.grammar import MATCHER_TYPE
from host.state.pages import InstancePages
from host.wasm.calling import calling
from host.wasm.instance import Instance

EXAMPLES = int(os.environ.get("PIE_FUZZ_EXAMPLES", "40"))
PAGES = 32
U32 = st.one_of(st.integers(0, 40), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
U64 = st.one_of(st.integers(0, 40), st.sampled_from([2**63 - 1, 2**63, 2**64 - 1]))
F32 = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                st.sampled_from([0.0, 1e-45, 1e-38, 1.0, 3.4e38, -0.0, -1.0]))
TEXT = st.text(max_size=40) | st.sampled_from(["", "\x00", "<|im_end|>", "a" * 4096])
SMALL_LIST = st.lists(U32, max_size=6)


def record(**fields: Any) -> Record:
    r = Record()
    r.__dict__.update(fields)
    return r


SAMPLER = st.builds(lambda t, k, p, m, s: record(**{"temperature": t, "top-k": k, "top-p": p, "min-p": m,
                                                     "seed": s}),
                    F32, U32, F32, F32, st.none() | U64)
OUTPUT_SPEC = st.builds(lambda i, s, d: record(index=i, sample=s, dist=d), U32, st.none() | SAMPLER, U32)
MESSAGE = st.builds(lambda r, c: record(role=r, content=c), TEXT, TEXT)
TIMEOUT = st.sampled_from([0, 1])  # never block the test for long


class Handle:
    """A resource handle argument: the i-th grammar / matcher made so far in this example (resolved at
    call time), or, past the end, a handle whose rep the instance does not hold."""

    def __init__(self, i: int) -> None:
        self.i = i


HANDLE = st.builds(Handle, st.integers(0, 4))
GRAMMAR_SRC = TEXT | st.sampled_from(['{"type": "object"}', '{"type": "integer", "minimum": 3}', "[0-9]+", "(",
                                      'root ::= "a"+', 'start: "x" | "y"', '{"type": "nonsense"}', "a" * 300_000])
FORWARD_PASS = (SMALL_LIST, U32, SMALL_LIST, SMALL_LIST, st.lists(SMALL_LIST, max_size=3),
                st.lists(OUTPUT_SPEC, max_size=3))
GEN_ARGS = (SMALL_LIST, U32, SMALL_LIST, SMALL_LIST, SAMPLER, st.integers(0, 12) | U32, SMALL_LIST,
            st.lists(TEXT, max_size=2), st.booleans())
FRESH_ARGS = (SMALL_LIST, SAMPLER, st.integers(0, 12) | U32, SMALL_LIST, st.lists(TEXT, max_size=2), st.booleans(),
              st.booleans())

# One strategy of argument tuples per import; the keys must cover every import (checked below).
ARGS: dict[str, st.SearchStrategy[tuple[Any, ...]]] = {
    "runtime.version": st.just(()), "runtime.instance-id": st.just(()), "runtime.arguments": st.just(()),
    "runtime.set-return": st.tuples(TEXT), "runtime.log": st.tuples(TEXT), "runtime.elapsed-ms": st.just(()),
    "runtime.set-priority": st.tuples(st.integers(-1001, 1001) | st.sampled_from([-2**31, 2**31 - 1])),
    "runtime.priority": st.just(()),
    "runtime.launch": st.tuples(TEXT | st.sampled_from(["", "0" * 64]), st.lists(TEXT, max_size=3), st.booleans()),
    "runtime.child-id": st.tuples(U32), "runtime.child-send": st.tuples(U32, TEXT),
    "runtime.child-receive": st.tuples(U32, st.none() | TIMEOUT), "runtime.child-wait": st.tuples(U32, TIMEOUT),
    "runtime.child-terminate": st.tuples(U32), "runtime.child-release": st.tuples(U32),
    "runtime.parent": st.just(()),
    "embed.hidden-size": st.just(()), "embed.image-tokens": st.just(()), "embed.image-token-id": st.just(()),
    "embed.embed-image": st.tuples(TEXT | st.sampled_from(["", "AQID", "!!not base64", "AQIDBA=="]), TEXT),
    "embed.embed-text": st.tuples(SMALL_LIST), "embed.slot-len": st.tuples(U32), "embed.release": st.tuples(SMALL_LIST),
    "embed.run": st.tuples(SMALL_LIST, U32, SMALL_LIST, SMALL_LIST, st.lists(st.tuples(U32, U32), max_size=2),
                           st.lists(OUTPUT_SPEC, max_size=3)),
    "embed.hidden": st.tuples(SMALL_LIST, U32, SMALL_LIST, SMALL_LIST, st.lists(st.tuples(U32, U32), max_size=2),
                              st.sampled_from(["last", "mean"]), st.booleans()),
    # (the rig's host allows no host: every request ends as an error result, none leaves the machine)
    "http.fetch": st.tuples(st.builds(lambda m, u, h, b, t: record(**{"method": m, "url": u, "headers": h, "body": b,
                                                                      "timeout-ms": t}),
                                      TEXT | st.sampled_from(["GET", "POST", "BREW"]),
                                      TEXT | st.sampled_from(["http://127.0.0.1/", "http://2130706433/", "file:///etc"]),
                                      st.lists(st.tuples(TEXT, TEXT), max_size=3), st.binary(max_size=64),
                                      st.none() | U32)),
    "messaging.send": st.tuples(TEXT), "messaging.receive": st.tuples(TIMEOUT),
    "messaging.publish": st.tuples(TEXT, TEXT), "messaging.subscribe": st.tuples(TEXT),
    "messaging.unsubscribe": st.tuples(TEXT), "messaging.receive-published": st.tuples(TIMEOUT),
    "store.get": st.tuples(TEXT), "store.set": st.tuples(TEXT, TEXT), "store.delete": st.tuples(TEXT),
    "store.exists": st.tuples(TEXT), "store.list-keys": st.just(()),
    "model.available-models": st.just(()), "model.load-model": st.tuples(TEXT), "model.model-name": st.just(()),
    "model.vocab-size": st.just(()), "model.stop-tokens": st.just(()), "model.chat-template": st.just(()),
    "model.apply-chat-template": st.tuples(st.lists(MESSAGE, max_size=3), st.booleans()),
    "model.apply-chat-template-json": st.tuples(TEXT | st.sampled_from(['[{"role": "user", "content": null}]', "[1]",
                                                                        '[{"role": "tool"}]', "[[[", "{}"]),
                                                 TEXT | st.just('[{"type": "function"}]'), st.booleans()),
    "model.encode": st.tuples(TEXT), "model.encode-prompt": st.tuples(TEXT), "model.decode": st.tuples(SMALL_LIST),
    "kv.page-size": st.just(()), "kv.free-pages": st.just(()), "kv.allocate": st.tuples(U32),
    "kv.release": st.tuples(SMALL_LIST), "kv.export-pages": st.tuples(TEXT, SMALL_LIST, st.booleans()),
    "kv.import-pages": st.tuples(TEXT), "kv.unexport": st.tuples(TEXT), "kv.list-exports": st.just(()),
    "kv.copy-tokens": st.tuples(U32, U32, U32, U32, U32),
    "kv.attach-prefix": st.tuples(st.lists(U32, max_size=12)),
    "forward.submit": st.tuples(SMALL_LIST, U32, SMALL_LIST, SMALL_LIST, st.lists(SMALL_LIST, max_size=3),
                                st.lists(OUTPUT_SPEC, max_size=3)),
    "forward.wait": st.tuples(U64), "forward.wait-any": st.tuples(st.lists(U64, max_size=3)),
    "forward.run": st.tuples(SMALL_LIST, U32, SMALL_LIST, SMALL_LIST, st.lists(SMALL_LIST, max_size=3),
                             st.lists(OUTPUT_SPEC, max_size=3)),
    "forward.decode-step": st.tuples(SMALL_LIST, U32, U32, U32, SAMPLER),
    "forward.run-scored": st.tuples(*FORWARD_PASS, st.lists(U32, max_size=3)),
    "forward.generate": st.tuples(*GEN_ARGS),
    "forward.generate-fresh": st.tuples(*FRESH_ARGS),
    "grammar.[static]grammar.from-json-schema": st.tuples(GRAMMAR_SRC),
    "grammar.[static]grammar.from-regex": st.tuples(GRAMMAR_SRC),
    "grammar.[static]grammar.from-ebnf": st.tuples(GRAMMAR_SRC),
    "grammar.[static]grammar.from-lark": st.tuples(GRAMMAR_SRC),
    "grammar.[static]grammar.any-json": st.just(()),
    "grammar.[method]grammar.matcher": st.tuples(HANDLE),
    "grammar.[method]matcher.accept": st.tuples(HANDLE, SMALL_LIST),
    "grammar.[method]matcher.rollback": st.tuples(HANDLE, U32),
    "grammar.[method]matcher.accepted": st.tuples(HANDLE),
    "grammar.[method]matcher.is-terminated": st.tuples(HANDLE),
    "grammar.[method]matcher.reset": st.tuples(HANDLE),
    "grammar.[method]matcher.fork": st.tuples(HANDLE),
    "forward.run-constrained": st.tuples(*FORWARD_PASS, U32, HANDLE),
    "forward.submit-constrained": st.tuples(*FORWARD_PASS, U32, HANDLE),
    "forward.decode-step-constrained": st.tuples(SMALL_LIST, U32, U32, U32, SAMPLER, HANDLE),
    "forward.generate-constrained": st.tuples(*GEN_ARGS, HANDLE),
}
CALL = st.sampled_from(sorted(ARGS)).flatmap(lambda name: st.tuples(st.just(name), ARGS[name]))


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, dict[str, Callable[..., Any]]]]:
    host = Host(HostConfig(data_dir=tmp_path_factory.mktemp("fuzz")),
                backend=StandInBackend(page_size=4, num_pages=PAGES))
    tables = import_tables(host.services)
    flat = {f"{iface}.{name}": fn for iface, table in tables.items() for name, fn in table.items()}
    yield host, flat
    host.shutdown()


def bound_instance(host: Host) -> Instance:
    """An instance (not started: the test thread plays its guest) bound to the calling thread."""
    inst = Instance(host._env, "0" * 64, ["fuzz"], lambda ev: None)
    calling.instance = inst
    return inst


def end(host: Host, inst: Instance) -> None:
    """What the host does when an instance ends, trapped or not."""
    calling.instance = None
    host._instance_ended(inst)


def test_every_import_has_a_strategy(rig) -> None:  # noqa: ANN001
    _host, flat = rig
    assert set(flat) == set(ARGS)


def resolve(arg: Any, handles: list[ResourceHost], store: wasmtime.Store) -> Any:
    """A Handle as the borrow a guest would pass (of a grammar or matcher made here, or a foreign one)."""
    if not isinstance(arg, Handle):
        return arg
    if arg.i < len(handles):
        return ResourceHost.borrow(handles[arg.i].rep, handles[arg.i].type).to_any(store)
    return ResourceHost.borrow(2**32 - 1 - arg.i, MATCHER_TYPE).to_any(store)  # never handed out


def good_forward(host: Host, flat: dict[str, Callable[..., Any]]) -> None:
    """A co-runner's pass: its answer is fixed by the stand-in model (next token = last + 1)."""
    inst = bound_instance(host)
    try:
        pages = flat["kv.allocate"](None, 1)
        spec = record(index=2, sample=record(**{"temperature": 0.0, "top-k": 0, "top-p": 1.0, "min-p": 0.0,
                                                "seed": None}), dist=0)
        out = flat["forward.run"](None, pages, 3, [7, 8, 9], [0, 1, 2], [], [spec])
        assert out[0].token == 10
    finally:
        end(host, inst)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(calls=st.lists(CALL, min_size=1, max_size=8))
def test_hostile_calls_return_or_trap_their_caller_only(rig, calls: list[tuple[str, tuple[Any, ...]]]) -> None:  # noqa: ANN001
    host, flat = rig
    inst = bound_instance(host)
    store = wasmtime.Store(host.wasm.engine)  # resolves the resource handles, as a guest's store
    handles: list[ResourceHost] = []
    try:
        for name, args in calls:
            args = tuple(resolve(a, handles, store) for a in args)
            try:
                got = flat[name](store, *args)
            except wasmtime.WasmtimeError as e:  # a trap: it must name the call, and ends the instance
                assert str(e).startswith(f"{name}: "), (name, args, str(e))
                assert "internal host error" not in str(e), (name, args, str(e))
                break
            if isinstance(got, ResourceHost):
                handles.append(got)
    finally:
        end(host, inst)
    assert inst.id not in host.services.grammars._tables, "grammars or matchers outlived their instance"
    cleanup = InstancePages("cleanup")  # same tenant: persistent exports outlive instances by design
    for name, _n in host.pages.list_exports(cleanup):
        host.pages.unexport(cleanup, name)
    assert host.free_pages() == PAGES, "pages leaked"
    good_forward(host, flat)
