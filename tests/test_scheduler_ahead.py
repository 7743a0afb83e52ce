"""Loops run ahead (a backend with `start_forward`) against the same loops run one step at a time
(the scheduler without it): the reference is the step-at-a-time path, an independent
implementation tested on its own (tests/test_host_generate.py, tests/test_prefix_cache.py).

For every loop, the steps the backend is given (tokens, positions, slots, seeds), the result
(tokens, finish, trim, pages grown), the streamed text, the prefix cache's view of its pages and
their write marks must be the same both ways; every page is unpinned at the end and the pages a
loop did not keep are free. Many loops share the batches, ending at different steps, on stop
tokens that fall mid-page and on a page's first slot (where the step prepared ahead had started
a page that must be given back), by length, by position, out of pages, with seeds and streams.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from gpu_backend.standin import StandInBackend
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host.batching.generation import Generation, StopRules
from host.batching.policy import AdaptivePolicy
from host.batching.scheduler import Scheduler
from host.state.pages import InstancePages, PageManager
from host.state.prefix_cache import PrefixCache

PS = 4
VOCAB = 256  # the stand-in draws (token + 1) % 256
CAP = 6  # pages per instance


@dataclass
class Spec:
    prompt: list[int]
    max_tokens: int
    stop: tuple[int, ...] = ()
    seed: int | None = None
    stream: bool = False
    stop_strings: tuple[str, ...] = ()
    max_position: int = 10_000


SPECS = [
    Spec([10, 11, 12], 20),  # length
    Spec([10, 11, 12], 1),  # the first step is the last
    Spec([10, 11, 12], 2),
    Spec([20, 21], 30, stop=(25,)),  # a stop token mid-page (slot 6 of 8)
    Spec([30, 31, 32], 30, stop=(34,)),  # the stop token's slot would open a page: the prepared page goes back
    Spec([40, 41, 42, 43], 30, stop=(44,)),  # the first drawn token is a stop token
    Spec([50], 40, stop=(70, 60)),  # the earlier of two
    Spec([60, 61], 25, seed=7),  # a seed per step
    Spec([65, 66, 67], 12, stream=True, stop=(73,)),  # streamed text, trimmed of the stop token
    Spec([70, 71], 20, stop_strings=("LM",)),  # stop strings: one step at a time, in the same batches
    Spec([80, 81, 82], 50, max_position=14),  # positions run out
    Spec([90, 91], 50),  # pages run out (CAP)
    Spec([250, 251], 30, stop=(3,)),  # wraps past the vocabulary
    Spec([100, 101, 102, 103, 104, 105, 106], 9),  # a prompt of more than a page
]


@dataclass
class Outcome:
    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=dict)  # loop -> the steps the backend ran
    results: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    streamed: dict[str, str] = field(default_factory=dict)
    slots: dict[str, list[int]] = field(default_factory=dict)  # loop -> its pages' slots as the backend holds them
    filled: dict[str, list[int]] = field(default_factory=dict)
    cached: dict[str, int] = field(default_factory=dict)  # loop -> full pages the prefix cache finds for it
    free: int = 0


def _record(rows: dict[str, list[tuple[Any, ...]]], reqs: Any) -> None:
    for r in reqs:
        seed = r.outputs[0].sample.seed if r.outputs and r.outputs[0].sample else None
        rows.setdefault(r.name, []).append((tuple(r.tokens), tuple(r.positions), len(r.pages), r.last_page_len, seed))


def _run(ahead: bool, specs: list[Spec], cancel: str | None = None, backend: Any = None,
         fed: bool = False, policy: Any = None) -> Outcome:
    """`specs` as loops through a scheduler (`backend`: the stand-in unless given; page size PS, 256 pages).
    `fed`: the loops' steps are launched before the batch drawing their tokens is waited for
    (`Feed`); the rows are recorded with the tokens the backend read."""
    be = backend if backend is not None else StandInBackend(page_size=PS, num_pages=256, delay_s=0.001)
    pm = PageManager(256, CAP, PrefixCache(PS))
    sched = Scheduler(policy)
    out = Outcome()
    lock = threading.Lock()

    def forward(reqs: Any) -> Any:
        with lock:
            _record(out.rows, reqs)
        return be.forward(reqs)

    def start(reqs: Any, feed: Any = None) -> Any:
        with lock:
            if feed is not None and hasattr(feed.source, "outputs"):  # the stand-in's fed tokens, as it reads them
                src = feed.source.outputs
                reqs = [replace(r, tokens=[src[feed.rows[feed.requests.index(i)]][0].token])
                        if i in feed.requests else r for i, r in enumerate(reqs)]
            _record(out.rows, reqs)
        return be.start_forward(reqs, feed)

    sched.bind(forward, be.copy_tokens, PS, pins=pm, start=start if ahead else None, feeds=fed)
    futs, gens, tables = {}, {}, {}
    try:
        for k, sp in enumerate(specs):
            name = f"loop{k}"
            table = InstancePages(owner=name)
            n = -(-len(sp.prompt) // PS)
            pages = pm.allocate(table, n)
            assert isinstance(pages, list)
            last = len(sp.prompt) - (n - 1) * PS
            sampler = SamplerParams(seed=sp.seed)
            req = ForwardRequest(pages=list(pages), last_page_len=last, tokens=list(sp.prompt),
                                 positions=list(range(len(sp.prompt))),
                                 outputs=[OutputSpec(index=len(sp.prompt) - 1, sample=sampler)], name=name)
            pm.note_write(table, req, PS)
            out.streamed[name] = ""
            send = (lambda text, name=name: out.streamed.__setitem__(name, out.streamed[name] + text)) \
                if sp.stream else None
            rules = StopRules(sp.max_tokens, frozenset(sp.stop), sp.stop_strings, sp.max_position)
            gen = Generation(req, sampler, rules, PS, pm, table, lambda ids: bytes(ids).decode("latin-1"), send)
            gens[name], tables[name] = gen, table
            futs[name] = sched.submit(req, name, generation=gen)
            if cancel == name:
                gen.cancelled = True
        for name, fut in futs.items():
            res = fut.wait(30)
            out.results[name] = (tuple(res.tokens), len(res.new_pages), res.trim, res.finish)
            table = tables[name]
            mine = [p for p in gens[name].request.pages if p in table.held]
            if isinstance(be, StandInBackend):
                out.slots[name] = [be.slots.get((p, s), -1) for p in mine for s in range(pm.filled(table, p))]
            out.filled[name] = [pm.filled(table, p) for p in mine]
            spec = specs[int(name[4:])]
            written = spec.prompt + list(res.tokens[:-1])
            out.cached[name] = len(pm.attach_prefix(table, written))
        assert all(pm.pinned(p) == 0 for p in range(256)), "a page is still pinned"
        for table in tables.values():
            pm.release_all(table)
        out.free = pm.free_count
    finally:
        sched.stop()
    return out


def test_loops_run_ahead_give_what_step_at_a_time_gives() -> None:
    ahead, step = _run(True, SPECS), _run(False, SPECS)
    assert ahead.results == step.results
    assert ahead.rows == step.rows
    assert ahead.streamed == step.streamed
    assert ahead.slots == step.slots and ahead.filled == step.filled
    assert ahead.cached == step.cached
    assert ahead.free == step.free == 256


def test_the_reference_path_gives_the_stand_ins_tokens() -> None:
    """The step-at-a-time results checked against the stand-in's rule itself (next = token + 1)."""
    step = _run(False, SPECS)
    for k, sp in enumerate(SPECS):
        res = step.results[f"loop{k}"]
        tokens, t = [], sp.prompt[-1]
        while True:
            t = (t + 1) % VOCAB
            tokens.append(t)
            if len(tokens) >= sp.max_tokens or t in sp.stop:
                break
        if sp.max_position < 10_000 or sp.stop_strings or len(sp.prompt) + sp.max_tokens > CAP * PS:
            assert list(res[0]) == tokens[: len(res[0])]  # cut short by a rule checked elsewhere
            continue
        assert list(res[0]) == tokens
        assert res[3] == ("stop-token" if tokens[-1] in sp.stop else "length")


def test_fed_loops_give_what_step_at_a_time_gives() -> None:
    """Each step launched before the last one's token is read on the host: the same results, steps,
    slots and cache views; a loop that ends on a stop token had one step more launched (its token
    the stop token, written past its end and given back), none other did."""
    fed, step = _run(True, SPECS, fed=True), _run(False, SPECS)
    assert fed.results == step.results
    assert fed.streamed == step.streamed
    assert fed.slots == step.slots and fed.filled == step.filled
    assert fed.cached == step.cached
    assert fed.free == step.free == 256
    for name, rows in step.rows.items():
        extra = fed.rows[name][len(rows):]
        assert fed.rows[name][: len(rows)] == rows, name
        if step.results[name][3] == "stop-token" and len(rows) > 1:
            assert len(extra) <= 1 and all(e[0] == (step.results[name][0][-1],) for e in extra), name
        else:
            assert extra == [], name
    assert any(len(fed.rows[n]) > len(r) for n, r in step.rows.items())  # some step was wasted


def test_fed_loops_overlap_the_batch_before() -> None:
    """Fed, the next batch is launched while the last one runs: the stand-in's device queue holds two."""
    be = StandInBackend(page_size=PS, num_pages=256, delay_s=0.01)
    starts: list[float] = []
    waits: list[float] = []
    real = be.start_forward

    class Timed:
        def __init__(self, step: Any) -> None:
            self.step = step

        def __getattr__(self, name: str) -> Any:  # what a Feed reads
            return getattr(self.step, name)

        def wait(self) -> Any:
            try:
                return self.step.wait()
            finally:
                waits.append(time.perf_counter())

    def start_forward(reqs: Any, feed: Any = None) -> Any:
        starts.append(time.perf_counter())
        return Timed(real(reqs, feed))

    be.start_forward = start_forward  # type: ignore[method-assign]
    _run(True, [Spec([10, 11, 12], 20)], backend=be, fed=True)
    # every later launch comes before the batch before it is waited for
    ahead = sum(1 for k in range(1, len(starts)) if starts[k] < waits[k - 1])
    assert ahead >= len(starts) - 3, (len(starts), ahead)


@pytest.mark.parametrize("fed", [False, True])
def test_a_loop_that_ends_while_others_run_holds_no_batch(fed: bool) -> None:
    """The policy waits for the owners of an ended loop only when no loop goes on (their instance may
    submit its next forward soon): with loops still running, their next batch goes at once."""
    done: list[list[str]] = []

    class Recording(AdaptivePolicy):
        def batch_done(self, owners: Any, start: float, end: float) -> None:
            done.append(list(owners))
            super().batch_done(owners, start, end)

    _run(True, [Spec([10, 11, 12], 3), Spec([20, 21], 40)], fed=fed, policy=Recording())
    assert done == [["loop1"]]  # loop0 ended while loop1 ran: not waited for


@pytest.mark.parametrize("fed", [False, True])
@pytest.mark.parametrize("which", [0, 3, 8])
def test_a_cancelled_loop_ends_and_frees_what_it_pinned(which: int, fed: bool) -> None:
    out = _run(True, SPECS, cancel=f"loop{which}", fed=fed)
    assert out.results[f"loop{which}"][3] == "cancelled"
    assert out.free == 256
