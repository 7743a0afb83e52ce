"""The host side of structured generation on the stand-in model (fast): the grammar imports, the
constrained forward calls and the constrained host loop, called as a guest calls them.

`MaskedStandIn` honours `OutputSpec.allowed` the way the real sampler does for its purpose here: the
stand-in's token when allowed, else the next allowed id (cyclically); a mask allowing nothing fails
the row. Handles are passed as the borrows a guest passes (`ResourceHost.borrow(...)` in a store).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import wasmtime
from wasmtime.component import Record, ResourceHost

from gpu_backend.standin import StandInBackend, StandInStep
from gpu_backend.types import ForwardError, ForwardRequest, OutputResult
from host import Host, HostConfig
from host.api import import_tables
from host.api.grammar import MAX_GRAMMARS, MAX_SOURCE_BYTES
from host.wasm.calling import calling
from host.wasm.instance import Instance


class MaskedStandIn(StandInBackend):
    seen: list[ForwardRequest]

    def start_forward(self, reqs: Any, feed: Any = None) -> StandInStep:
        self.__dict__.setdefault("seen", []).extend(reqs)
        step = super().start_forward(reqs, feed)
        out = step.outputs
        vocab = self.info.vocab_size
        for i, (req, res) in enumerate(zip(reqs, out, strict=True)):
            for j, spec in enumerate(req.outputs):
                if spec.allowed is None:
                    continue
                ok = np.unpackbits(np.frombuffer(spec.allowed, np.uint8), bitorder="little")[:vocab].astype(bool)
                if not ok.any():
                    raise ForwardError(i, "its allowed-token mask allows no token")
                t = res[j].token
                later = np.flatnonzero(ok[t:])
                res[j] = OutputResult(int(t + later[0]) if later.size else int(np.flatnonzero(ok)[0]), [], [])
        return step


def rec(**fields: Any) -> Record:
    r = Record()
    r.__dict__.update(fields)
    return r


SAMPLER = rec(**{"temperature": 0.0, "top-k": 0, "top-p": 1.0, "min-p": 0.0, "seed": None})


class Guest:
    """Calls imports as one instance's guest does; `new` keeps own handles, `h` lends a borrow."""

    def __init__(self, host: Host, flat: dict[str, Callable[..., Any]]) -> None:
        self.host, self.flat = host, flat
        self.inst = Instance(host._env, "0" * 64, ["test"], lambda ev: None)
        self.store = wasmtime.Store(host.wasm.engine)
        calling.instance = self.inst

    def __call__(self, name: str, *args: Any) -> Any:
        return self.flat[name](self.store, *args)

    def h(self, own: ResourceHost) -> Any:
        return ResourceHost.borrow(own.rep, own.type).to_any(self.store)

    def end(self) -> None:
        calling.instance = None
        self.host._instance_ended(self.inst)


@pytest.fixture
def guest(tmp_path) -> Iterator[Guest]:  # noqa: ANN001
    host = Host(HostConfig(data_dir=tmp_path), backend=MaskedStandIn(page_size=4, num_pages=32))
    flat = {f"{i}.{n}": fn for i, t in import_tables(host.services).items() for n, fn in t.items()}
    g = Guest(host, flat)
    yield g
    g.end()
    assert g.inst.id not in host.services.grammars._tables
    assert host.free_pages() == 32
    host.shutdown()


def matcher(g: Guest, pattern: str) -> ResourceHost:
    gr = g("grammar.[static]grammar.from-regex", pattern)
    assert isinstance(gr, ResourceHost), gr
    m = g("grammar.[method]grammar.matcher", g.h(gr))
    assert isinstance(m, ResourceHost), m
    return m


def test_generate_constrained_follows_the_grammar_and_stops_when_it_ends(guest: Guest) -> None:
    m = matcher(guest, "[a-c]{2}x[0-9]")
    pages = guest("kv.allocate", 1)
    out = guest("forward.generate-constrained", pages, 3, [70, 71, 72], [0, 1, 2], SAMPLER, 20, [], [], False,
                 guest.h(m))
    text = bytes(out.tokens[:-1]).decode("latin-1")
    assert re.fullmatch("[a-c]{2}x[0-9]", text) and out.tokens[-1] == 0, out.tokens  # 0: the stop token
    assert (out.finish, out.trim) == ("stop-token", 1)
    assert guest("grammar.[method]matcher.is-terminated", guest.h(m))
    assert guest("grammar.[method]matcher.accepted", guest.h(m)) == len(out.tokens)
    guest("kv.release", pages + list(out.__dict__["new-pages"]))


def test_run_submit_and_decode_step_constrained_advance_the_matcher(guest: Guest) -> None:
    m = matcher(guest, "q+r")
    pages = guest("kv.allocate", 2)
    spec = rec(index=1, sample=SAMPLER, dist=0)
    (o,) = guest("forward.run-constrained", pages, 2, [5, 6], [0, 1], [], [spec], 0, guest.h(m))
    assert o.token == ord("q")  # the stand-in says 7: the next allowed id is 'q'
    hold, busy = threading.Event(), threading.Event()
    threading.Thread(target=guest.host.scheduler.call, args=(lambda: (busy.set(), hold.wait()),), daemon=True).start()
    assert busy.wait(10)  # the scheduler thread is busy: the pass below stays queued until `hold` is set
    try:
        guest("forward.submit-constrained", pages, 3, [o.token], [2], [], [rec(index=0, sample=SAMPLER, dist=0)],
              0, guest.h(m))
        with pytest.raises(wasmtime.WasmtimeError, match=r"^grammar.\[method\]matcher.accept: .*not yet waited"):
            guest("grammar.[method]matcher.accept", guest.h(m), [ord("q")])
    finally:
        hold.set()


def test_submit_then_wait_advances_and_decode_step_follows(guest: Guest) -> None:
    m = matcher(guest, "q+r")
    pages = guest("kv.allocate", 2)
    h = guest("forward.submit-constrained", pages, 1, [5], [0], [], [rec(index=0, sample=SAMPLER, dist=0)], 0,
              guest.h(m))
    (o,) = guest("forward.wait", h)
    assert o.token == ord("q") and guest("grammar.[method]matcher.accepted", guest.h(m)) == 1
    t = guest("forward.decode-step-constrained", pages, 2, o.token, 1, SAMPLER, guest.h(m))
    assert t == ord("r")  # 'q' + 1 is allowed
    assert guest("forward.decode-step-constrained", pages, 3, t, 2, SAMPLER, guest.h(m)) == 0  # the stop token
    err = guest("forward.decode-step-constrained", pages, 4, 0, 3, SAMPLER, guest.h(m))
    assert isinstance(err, str) and "terminated" in err
    guest("kv.release", pages)


def test_a_grammar_admitting_no_token_is_an_error_and_changes_nothing(guest: Guest) -> None:
    gr = guest("grammar.[static]grammar.from-lark", "start: N\nN: /[a-z]+/ & /[0-9]+/")
    m = guest("grammar.[method]grammar.matcher", guest.h(gr))
    pages = guest("kv.allocate", 1)
    free = guest.host.free_pages()
    err = guest("forward.generate-constrained", pages, 1, [5], [0], SAMPLER, 8, [], [], False, guest.h(m))
    assert isinstance(err, str) and "admits no token" in err
    assert guest.host.free_pages() == free and guest("grammar.[method]matcher.accepted", guest.h(m)) == 0
    guest("kv.release", pages)


def test_bad_grammars_and_limits_come_back_as_errors(guest: Guest) -> None:
    assert "invalid regex '('" in guest("grammar.[static]grammar.from-regex", "(")
    assert "invalid JSON schema" in guest("grammar.[static]grammar.from-json-schema", '{"type": 5}')
    assert "over the limit" in guest("grammar.[static]grammar.from-lark", "x" * (MAX_SOURCE_BYTES + 1))
    held = [guest("grammar.[static]grammar.any-json") for _ in range(MAX_GRAMMARS)]
    assert all(isinstance(h, ResourceHost) for h in held)
    assert "64 grammars (the limit)" in guest("grammar.[static]grammar.from-regex", "a")


def test_foreign_and_dropped_handles_trap_the_caller(guest: Guest) -> None:
    m = matcher(guest, "a")
    with pytest.raises(wasmtime.WasmtimeError, match=r"^grammar.\[method\]matcher.reset: unknown matcher handle"):
        guest("grammar.[method]matcher.reset", ResourceHost.borrow(m.rep + 1000, m.type).to_any(guest.store))
    guest.host.services.grammars.release_rep(guest.inst, m.rep, "matchers")  # what a guest drop does
    with pytest.raises(wasmtime.WasmtimeError, match="unknown matcher handle"):
        guest("grammar.[method]matcher.is-terminated", guest.h(m))


def test_fork_rollback_and_reset(guest: Guest) -> None:
    m = matcher(guest, "ab|ac")
    assert guest("grammar.[method]matcher.accept", guest.h(m), [ord("a"), ord("a")]) == 1
    twin = guest("grammar.[method]matcher.fork", guest.h(m))
    assert guest("grammar.[method]matcher.accept", guest.h(twin), [ord("c"), 0]) == 2
    assert guest("grammar.[method]matcher.is-terminated", guest.h(twin))
    assert guest("grammar.[method]matcher.accepted", guest.h(m)) == 1
    guest("grammar.[method]matcher.rollback", guest.h(twin), 1)
    assert not guest("grammar.[method]matcher.is-terminated", guest.h(twin))
    with pytest.raises(wasmtime.WasmtimeError, match="rollback of 5 tokens, but the matcher has accepted only 2"):
        guest("grammar.[method]matcher.rollback", guest.h(twin), 5)


def test_unconstrained_requests_carry_no_mask(guest: Guest) -> None:
    backend = guest.host.backend
    assert isinstance(backend, MaskedStandIn)
    pages = guest("kv.allocate", 1)
    guest("forward.generate", pages, 1, [5], [0], SAMPLER, 3, [], [], False)
    guest("forward.decode-step", pages, 4, 8, 3, SAMPLER)
    assert len(backend.seen) == 4 and all(o.allowed is None for r in backend.seen for o in r.outputs)
    guest("kv.release", pages)
