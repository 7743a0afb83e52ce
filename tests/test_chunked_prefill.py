"""Chunked prefill (host/batching/chunks.py) with the stand-in: how a long forward is split, that
the chunks run in order with the running loops in every batch, and that every output (plain
forwards with masks and output indices, host-side loops) is what the unchunked run gives.
The real model: tests/test_chunked_prefill_model.py."""

from __future__ import annotations

import statistics
import threading
from typing import Any

import pytest
from fakes import FakeBackend

from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host.batching.chunks import chunk_request
from host.batching.generation import Generation, StopRules
from host.batching.policy import AdaptivePolicy
from host.batching.scheduler import Scheduler
from host.batching.stepcost import PROBE_TOKENS, StepCost
from host.state.pages import InstancePages, PageManager
from host.state.prefix_cache import PrefixCache

PS = 4
GREEDY = SamplerParams()


def _brle(attend: list[bool]) -> list[int]:
    runs, cur, n = [], True, 0
    for a in attend:
        if a == cur:
            n += 1
        else:
            runs.append(n)
            cur, n = a, 1
    return runs + [n]


def long_request(pages: list[int], context: int, n: int, mask: bool = False, base: int = 0) -> ForwardRequest:
    """`n` new tokens after `context` ones, on `pages`; outputs at a few indices out of order,
    some sampled (greedy and seeded), some distributions; with `mask`: a sliding window of 5."""
    total = context + n
    assert len(pages) == -(-total // PS)
    rows = None
    if mask:
        rows = [_brle([j > context + i - 5 for j in range(context + i + 1)]) for i in range(n)]
    outputs = [OutputSpec(index=n - 1, sample=GREEDY), OutputSpec(index=2, dist=3),
               OutputSpec(index=n // 2, sample=SamplerParams(temperature=1.0, seed=5)),
               OutputSpec(index=0, sample=GREEDY, target=base + 1)]
    return ForwardRequest(pages=pages, last_page_len=total - (len(pages) - 1) * PS,
                          tokens=[(base + 3 * i) % 200 + 2 for i in range(n)],
                          positions=list(range(context, total)), mask=rows, outputs=outputs, name="long")


def test_chunks_partition_the_request() -> None:
    req = long_request(list(range(10)), context=5, n=33, mask=True)
    parts, start = [], 0
    for n in (8, 8, 8, 8, 8):
        if start >= 33:
            break
        part, which = chunk_request(req, start, n, PS)
        assert part.context_len(PS) == 5 + start  # each chunk attends to everything before it
        assert part.pages == req.pages[:len(part.pages)] and 1 <= part.last_page_len <= PS
        assert [req.outputs[k].index - start for k in which] == [o.index for o in part.outputs]
        assert all(0 <= o.index < len(part.tokens) for o in part.outputs)
        assert part.mask is not None
        assert [sum(row) for row in part.mask] == [part.context_len(PS) + i + 1 for i in range(len(part.tokens))]
        parts.append((part, which))
        start += len(part.tokens)
    assert [len(p.tokens) for p, _ in parts] == [8, 8, 8, 8, 1]
    assert sum((p.tokens for p, _ in parts), []) == req.tokens
    assert sum((p.positions for p, _ in parts), []) == req.positions
    assert sum((p.mask or [] for p, _ in parts), []) == req.mask
    assert sorted(sum((w for _, w in parts), [])) == list(range(len(req.outputs)))
    last = parts[-1][0]
    assert last.pages == req.pages and last.last_page_len == req.last_page_len


class Recording(FakeBackend):
    """The stand-in whose tokens depend on everything attended (`reads`), recording each batch as
    (owner, new tokens) rows."""

    def __init__(self, delay_s: float = 0.0) -> None:
        super().__init__(page_size=PS, num_pages=128, delay_s=delay_s, reads=True)
        self.rows: list[list[tuple[str, int]]] = []

    def start_forward(self, reqs: Any, feed: Any = None) -> Any:
        self.rows.append([(r.name, len(r.tokens)) for r in reqs])
        return super().start_forward(reqs, feed)


def _scheduler(be: Recording, chunk: int | str, pm: PageManager | None = None) -> Scheduler:
    s = Scheduler(AdaptivePolicy(), prefill_chunk=chunk)
    s.bind(be.forward, be.copy_tokens, PS, pins=pm, start=be.start_forward, feeds=True)
    return s


def _plain(chunk: int, mask: bool) -> tuple[Any, Recording, dict[str, Any]]:
    """A prefix forward of 6 tokens, then a long one after it on the same pages (the same owner),
    then a later decode step of that owner: outputs, the backend, the stats."""
    be = Recording()
    s = _scheduler(be, chunk)
    try:
        first = ForwardRequest(pages=[0, 1], last_page_len=2, tokens=[9, 8, 7, 6, 5, 4], positions=list(range(6)),
                               outputs=[OutputSpec(index=5, sample=GREEDY)], name="long")
        long = long_request(list(range(10)), context=6, n=31, mask=mask)
        step = ForwardRequest(pages=list(range(10)), last_page_len=long.last_page_len + 1, tokens=[11],
                              positions=[37], outputs=[OutputSpec(index=0, sample=GREEDY, dist=2)], name="long")
        other = ForwardRequest(pages=[20], last_page_len=3, tokens=[1, 2, 3], positions=[0, 1, 2],
                               outputs=[OutputSpec(index=2, sample=GREEDY)], name="other")
        futs = [s.submit(first, "a"), s.submit(long, "a"), s.submit(step, "a"), s.submit(other, "b")]
        out = [f.wait(10) for f in futs]
        slots = {k: v for k, v in be.slots.items() if k[0] < 10}
        return (out, slots), be, s.stats.as_dict()
    finally:
        s.stop()


@pytest.mark.parametrize("mask", [False, True])
def test_a_chunked_forward_gives_the_unchunked_outputs(mask: bool) -> None:
    (whole, whole_slots), _be, st0 = _plain(0, mask)
    (chunked, slots), be, st = _plain(8, mask)
    assert chunked == whole and slots == whole_slots
    assert st0["chunked_prefills"] == 0 and st["chunked_prefills"] == 1 and st["prefill_chunks"] == 4
    long_rows = [n for batch in be.rows for name, n in batch if name == "long"]
    assert long_rows == [6, 8, 8, 8, 7, 1]  # in order; the owner's next step after its last chunk
    # the other owner's forward did not wait for the long one's chunks
    assert any(("other", 3) in batch for batch in be.rows[:3])


def test_a_failed_chunk_fails_its_forward_and_frees_its_pins() -> None:
    be = Recording()
    pm = PageManager(128, None, PrefixCache(PS))
    table = InstancePages(owner="a")
    pages = pm.allocate(table, 8)
    assert isinstance(pages, list)
    s = _scheduler(be, 8, pm)
    calls = {"n": 0}
    start = be.start_forward

    def flaky(reqs: Any, feed: Any = None) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("CUDA fell over")
        return start(reqs, feed)

    s.bind(be.forward, be.copy_tokens, PS, pins=pm, start=flaky, feeds=True)
    try:
        fut = s.submit(long_request(pages, context=0, n=30), "a")
        with pytest.raises(RuntimeError, match="CUDA fell over"):
            fut.wait(10)
        after = s.submit(ForwardRequest(pages=[pages[0]], last_page_len=1, tokens=[5], positions=[0],
                                        outputs=[OutputSpec(index=0, sample=GREEDY)], name="a"), "a")
        assert after.wait(10)[0].token is not None
        assert all(pm.pinned(p) == 0 for p in pages)
        assert not s.busy()
    finally:
        s.stop()


def _loops(chunk: int | str, prompt_len: int, loops: int = 4, delay_s: float = 0.002, token_s: float = 0.0,
           stats: dict[str, Any] | None = None, loop_prompt: int = 2,
           loop_tokens: int = 30, longs: int = 1, cost: StepCost | None = None) -> tuple[dict[str, Any], Recording]:
    """`loops` host-side loops start, then one with a `prompt_len` prompt ("long"; `longs` > 1: as
    many at once, "long0", "long1", ...): every loop's result, the backend (a step of `delay_s` +
    `token_s` a new token); `stats`: filled with the scheduler's; `cost`: the scheduler's step cost
    (`--prefill-chunk auto`), kept as given (the batches run do not change it)."""
    be = Recording(delay_s=delay_s)
    be.token_s = token_s
    pm = PageManager(128, None, PrefixCache(PS))
    s = _scheduler(be, chunk, pm)
    if cost is not None:
        cost.observe = lambda *_a, **_k: None  # type: ignore[method-assign]
        s.cost = cost
    futs = {}
    try:
        def start(name: str, prompt: list[int], max_tokens: int, seed: int | None = None) -> None:
            table = InstancePages(owner=name)
            n = -(-len(prompt) // PS)
            pages = pm.allocate(table, n)
            assert isinstance(pages, list)
            sampler = SamplerParams(temperature=1.0 if seed is not None else 0.0, seed=seed)
            req = ForwardRequest(pages=list(pages), last_page_len=len(prompt) - (n - 1) * PS, tokens=list(prompt),
                                 positions=list(range(len(prompt))),
                                 outputs=[OutputSpec(index=len(prompt) - 1, sample=sampler)], name=name)
            pm.note_write(table, req, PS)
            gen = Generation(req, sampler, StopRules(max_tokens, frozenset({0}), (), 10_000), PS, pm, table,
                             lambda ids: "", None)
            futs[name] = s.submit(req, name, generation=gen)

        for k in range(loops):
            start(f"loop{k}", [10 + k, 20 + k] + [(5 * i + k) % 190 + 3 for i in range(loop_prompt - 2)], loop_tokens,
                  seed=k if k % 2 else None)
        while len(be.rows) < 3:  # the loops are running
            threading.Event().wait(0.001)
        for j in range(longs):
            start("long" if longs == 1 else f"long{j}", [(7 * i + j) % 190 + 3 for i in range(prompt_len)], 5)
        results = {name: tuple(f.wait(30).tokens) for name, f in futs.items()}
        assert all(pm.pinned(p) == 0 for p in range(128))
        if stats is not None:
            stats.update(s.stats.as_dict())
        return results, be
    finally:
        s.stop()


def test_running_loops_step_in_every_batch_while_a_prompt_is_chunked() -> None:
    whole, whole_be = _loops(0, 37)
    chunked, be = _loops(8, 37)
    assert chunked == whole
    long_batches = [batch for batch in be.rows if any(name == "long" and n > 1 for name, n in batch)]
    assert [n for batch in long_batches for name, n in batch if name == "long"] == [8, 8, 8, 8, 5]
    for batch in long_batches:  # every loop still running steps in each of them
        assert {name for name, n in batch if name.startswith("loop")} == {f"loop{k}" for k in range(4)}
    assert [n for b in whole_be.rows for name, n in b if name == "long"][0] == 37


def test_chunks_in_one_batch_take_at_most_the_chunk_together() -> None:
    be = Recording()
    s = _scheduler(be, 8)
    try:
        a = s.submit(long_request(list(range(5)), context=0, n=20), "a")
        b = s.submit(long_request(list(range(20, 25)), context=0, n=20, base=50), "b")
        a.wait(10)
        b.wait(10)
        assert all(sum(n for _name, n in batch) <= 8 for batch in be.rows)
    finally:
        s.stop()


def test_the_flag_reaches_the_config_and_a_bad_value_is_refused() -> None:
    import argparse

    from host.cli.options import add_host_options, host_config_from_args
    from host.config import HostConfig

    ap = argparse.ArgumentParser()
    add_host_options(ap)
    assert host_config_from_args(ap.parse_args(["--prefill-chunk", "64"])).prefill_chunk == 64
    assert host_config_from_args(ap.parse_args([])).prefill_chunk == HostConfig().prefill_chunk == "auto"
    cfg = host_config_from_args(ap.parse_args(["--prefill-chunk", "auto", "--prefill-ratio", "2"]))
    assert cfg.prefill_chunk == "auto" and cfg.prefill_ratio == 2.0
    with pytest.raises(SystemExit):
        ap.parse_args(["--prefill-chunk", "big"])
    for bad in (-1, "big", 1.5, True):
        with pytest.raises(ValueError, match="prefill_chunk"):
            HostConfig(prefill_chunk=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="prefill_ratio"):
        HostConfig(prefill_ratio=1.0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        Scheduler(prefill_chunk="often")


# ---- --prefill-chunk auto (host/batching/stepcost.py) ----

def _fitted(fixed_s: float, token_s: float, sizes: tuple[int, ...] = (16, 16, 272, 16, 1024)) -> StepCost:
    cost = StepCost()
    cost.observe(256, 100.0)  # the first batch (the backend's warm-up): not counted
    for n in sizes:
        cost.observe(n, fixed_s + token_s * n, prefill=0 if n == 16 else n - 16)
    return cost


def test_the_step_cost_fit_and_the_budget_it_gives() -> None:
    dev = _fitted(0.010, 20e-6)  # a device: a step is mostly its fixed part
    assert dev.fit is not None and dev.fit == pytest.approx((0.010, 20e-6))
    assert dev.prefill_budget(16, 10240) in (257, 258)  # 0.5 * (0.010 / 20e-6 + 16)
    cpu = _fitted(0.050, 15e-3)  # the model on CPU: a token costs about what the fixed part does
    assert cpu.prefill_budget(16, 10240) in (8, 9)  # 0.5 * (0.050 / 15e-3 + 16) = 9.67
    assert cpu.fit_ms_us() == (50.0, 15000.0)
    # the decode-only steps' own time anchors the prediction, whatever the line's intercept: the
    # prefill batches here lie on 2.7 s + 22.8 ms a token, the decode steps (16 tokens) take 0.33 s
    odd = StepCost()
    odd.observe(256, 9.0)  # (warm-up)
    for n in (16, 79, 16, 300, 16, 40, 16):
        odd.observe(n, 0.33 if n == 16 else 2.7 + 0.0228 * n, prefill=0 if n == 16 else n - 16)
    # what a prefill token added to a decode step there: (2.7 + 0.0228 n - 0.33) / (n - 16), 37-66 ms,
    # so 0.5 * 0.33 / that: 2-4 tokens; the line's own intercept would give 0.5 * (2.7 / 0.0228 + 16) = 67
    assert 1 <= odd.prefill_budget(16, 10240) <= 4
    assert odd.prefill_budget(64, 10240) > odd.prefill_budget(16, 10240)  # more decodes: more room
    assert dev.prefill_budget(0, 10240) == 10240  # no running decodes: max_batch_tokens only
    assert dev.prefill_budget(16, 200) == 184  # never past max_batch_tokens
    assert StepCost().prefill_budget(16, 10240) == 16  # no fit yet: a probe, as many tokens as the decodes'
    assert StepCost().prefill_budget(2, 10240) == PROBE_TOKENS  # (at least this many)
    one = StepCost()
    one.observe(1024, 0.5)  # (warm-up)
    one.observe(16, 0.01)
    one.observe(16, 0.012)
    assert one.fit is None  # one size class: no slope
    one.observe(24, 0.011)
    assert one.fit is None  # 16 and 24 tokens: too narrow a range to trust (noise)
    one.observe(48, 0.016)
    fit = one.fit
    assert fit is not None
    assert fit == pytest.approx((0.007818, 0.0001705), rel=0.01)  # (16-31: 18.7 tokens, 11 ms; 48: 16 ms)
    free = _fitted(0.010, 0.0)
    assert free.prefill_budget(16, 10240) == 2 * 1008  # tokens cost nothing: twice the most measured
    narrow = StepCost()
    narrow.observe(256, 1.0)  # (warm-up)
    for n in (16, 16, 32, 16):  # 16 decodes alone, then with a 16-token probe: the slope is noise
        narrow.observe(n, 0.0103, prefill=n - 16)
    assert narrow.prefill_budget(16, 10240) == 32  # not the whole prompt: twice the probe
    r2 = StepCost(ratio=2.0)
    for n in (16, 16, 1024):
        r2.observe(n, 0.010 + 20e-6 * n, prefill=n - 16)
    assert r2.prefill_budget(16, 10240) in (515, 516)
    with pytest.raises(ValueError, match="ratio"):
        StepCost(ratio=1.0)


def test_auto_takes_the_prefills_within_the_budget_and_decodes_whole() -> None:
    from host.batching.future import ForwardFuture
    from host.batching.queue import JobQueue

    q = JobQueue()
    q.append(ForwardFuture(long_request(list(range(10)), context=0, n=40), "a"))
    q.append(ForwardFuture(long_request(list(range(20, 30)), context=0, n=40, base=50), "b"))
    step = ForwardRequest(pages=[40], last_page_len=2, tokens=[5], positions=[1],
                          outputs=[OutputSpec(index=0, sample=GREEDY)], name="c")
    q.append(ForwardFuture(step, "c"))
    _copies, batch = q.take(True, [], PS, 10240, budget=10)
    sent = [(f.owner, len((f.chunks.part if f.parent is None and f.chunks else f.request).tokens)) for f in batch]
    assert sent == [("a", 10), ("c", 1)]  # a's first chunk takes the budget; b waits; the decode joins
    _copies, batch = q.take(True, [], PS, 10240, budget=64)
    assert [(f.owner, len(f.request.tokens)) for f in batch] == [("b", 40)]  # (a's chunk is in flight) whole


def test_auto_serves_tenants_in_turn_within_the_budget() -> None:
    from host.batching.future import ForwardFuture
    from host.batching.queue import JobQueue
    from host.levels import Turns

    q = JobQueue()
    futs = []
    for k in range(3):
        f = ForwardFuture(long_request(list(range(10 * k, 10 * k + 8)), context=0, n=30, base=k), f"a{k}")
        f.tenant = "A"
        futs.append(f)
    late = ForwardFuture(long_request(list(range(40, 48)), context=0, n=30, base=9), "b0")
    late.tenant = "B"
    for f in [*futs, late]:
        q.append(f)
    turns = Turns()
    chosen = q.choose(0, 10240, 0, turns, 0.0, budget=40)
    assert chosen == {futs[0]: 30, late: 10}  # A's first and B's, in turn (a tie: queue order); not A's backlog
    turns.served({"A": 30, "B": 10})
    assert q.choose(0, 10240, 0, turns, 0.0, budget=40) == {late: 30, futs[0]: 10}  # B got less: B first now
    _copies, batch = q.take(True, [], PS, 10240, budget=40, chosen={late: 30, futs[0]: 10})
    assert [(f.owner, len(f.request.tokens)) for f in batch] == [("a0", 10), ("b0", 30)]  # the shares chosen
    assert q.choose(0, 10240, 0, Turns(), 0.0, budget=1000) is None  # all fit


@pytest.mark.heavy  # (~9-16 s a case: 100 ms steps on purpose; make test runs it)
@pytest.mark.parametrize(("token_s", "chunked", "n"), [(10e-3, True, 120), (400e-6, False, 100)])
def test_auto_sizes_the_chunk_by_the_measured_step_cost(token_s: float, chunked: bool, n: int) -> None:
    """A stand-in whose step takes 100 ms + `token_s` a new token (slow steps: a loaded machine's
    delays are small against the token costs measured); 4 loops start with 24-token prompts
    (a 96-token batch, not counted: the first batch; then 4-token steps), so the prompt's first
    chunk is a probe of 8 tokens, which gives the fit its range. On a CPU-like cost (10 ms a token)
    the budget with 4 decodes is ~0.5 * (10 + 4) = 7 tokens, so a 120-token prompt runs in many small
    chunks; on a device-like one (400 us) ~0.5 * (250 + 4) = 127, so a 100-token one runs in a few,
    doubling (the budget goes no further than twice the most prefill tokens measured).
    Outputs as unchunked."""
    whole, _ = _loops(0, n, delay_s=0.100, token_s=token_s, loop_prompt=24, loop_tokens=40)
    st: dict[str, Any] = {}
    auto, be = _loops("auto", n, delay_s=0.100, token_s=token_s, stats=st, loop_prompt=24, loop_tokens=40)
    assert auto == whole
    long_rows: list[int] = []  # its prefill's chunks (its decode steps after them)
    for k in (k for batch in be.rows for name, k in batch if name == "long"):
        if sum(long_rows) < n:
            long_rows.append(k)
    assert sum(long_rows) == n
    if chunked:
        # (7 on an idle machine; a loaded one's delays move it either way)
        assert long_rows[0] == PROBE_TOKENS and len(long_rows) >= 6, long_rows
        assert statistics.median(long_rows[1:]) <= 20, long_rows
        assert st["chunked_prefills"] == 1, st
        assert st["step_token_us"] > 3000, st  # the fit saw the per-token cost
    else:
        # the probe, then doubling as the range measured widens (8, 16, 32, 64: the rest)
        assert long_rows[0] == PROBE_TOKENS and len(long_rows) <= 6 and max(long_rows) >= 40, long_rows
        assert st["prefill_budget"] >= 60 and st["step_token_us"] <= 2000, st  # (400 us; a loaded machine adds)


def test_auto_gives_each_queued_prefill_its_own_budget() -> None:
    """Four prompts come at once while four loops decode, on a CPU-like step cost (100 ms + 5 ms a
    token: a budget of ~0.5 * (100 / 5 + 4) = 12 prefill tokens with 4 decodes). Each prompt gets
    its own 12 tokens a batch, so all four are prefilled in the batches one of them takes alone
    (40 tokens: 4). One budget for all of them (the old rule) lined them up, 12 tokens a batch for
    all four: 14 batches, with the loops' steps at most 1.5x slower but the prompts 4x later; a
    load whose prefills need more than (ratio - 1) / ratio of the backend's time (agents on the
    model on CPU, bench/agent_io.md) then queued them without bound. Outputs as unchunked."""
    from host.batching.future import ForwardFuture
    from host.batching.queue import JobQueue, decode_tokens

    whole, _ = _loops(0, 40, longs=4, loop_tokens=40)
    cost = _fitted(0.100, 5e-3)
    assert cost.prefill_budget(4, 10240) in (11, 12)  # (12 less a rounding)
    auto, be = _loops("auto", 40, longs=4, loop_tokens=40, cost=cost)
    assert auto == whole
    longs = {f"long{j}" for j in range(4)}
    rows = [i for i, batch in enumerate(be.rows) if any(name in longs and n > 1 for name, n in batch)]
    chunks = [n for i in rows for name, n in be.rows[i] if name in longs and n > 1]
    assert sum(chunks) == 4 * 40 and max(chunks) <= 12, chunks
    assert rows[-1] - rows[0] + 1 <= 6, [be.rows[i] for i in rows]  # (4 on an idle machine; 14 with one budget)

    # the queue's part: each prefill takes at most its share of the budget
    q = JobQueue()
    for k, owner in enumerate("abc"):
        q.append(ForwardFuture(long_request(list(range(10 * k, 10 * k + 10)), context=0, n=40, base=k), owner))
    q.append(ForwardFuture(ForwardRequest(pages=[40], last_page_len=2, tokens=[5], positions=[1],
                                          outputs=[OutputSpec(index=0, sample=GREEDY)], name="d"), "d"))
    assert decode_tokens(q.jobs) == (1, 3)
    _copies, batch = q.take(True, [], PS, 10240, budget=30, share=10)
    assert [(f.owner, len(f.request.tokens)) for f in batch] == [("a", 10), ("b", 10), ("c", 10), ("d", 1)]
    assert decode_tokens(q.jobs) == (0, 0)  # (their chunks are in flight)
