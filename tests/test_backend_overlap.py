"""`TorchBackend.start_forward` (the real backend overlapping the host) against `forward`, on CPU: the
batch runs on the backend's worker thread. Same outputs, token for token; requests read at the
call; calls run in the order they are made; bad requests fail at the call; and the scheduler's
loops run ahead on it give what they give one step at a time. On CUDA the kit runs the same
checks (tests/test_backend_gpu.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from backend_checks import tiny_backend
from test_scheduler_ahead import PS, SPECS, _run

from gpu_backend import ForwardError, ForwardRequest, OutputSpec, SamplerParams


def _req(name: str, pages: list[int], ctx: int, tokens: list[int], outputs: list[OutputSpec],
         mask: list[list[int]] | None = None) -> ForwardRequest:
    total = ctx + len(tokens)
    used = -(-total // PS)
    return ForwardRequest(pages=pages[:used], last_page_len=total - (used - 1) * PS, tokens=tokens,
                          positions=list(range(ctx, total)), mask=mask, outputs=outputs, name=name)


def _batches() -> list[list[ForwardRequest]]:
    """Prefill (ragged, a BRLE tree row, dists, seeded and unseeded sampling), then decode steps."""
    greedy, seeded = SamplerParams(), SamplerParams(temperature=0.8, top_k=20, seed=11)
    a, b, c = [0, 1, 5], [2, 4, 6], [3]
    steps = [[
        _req("a", a, 0, [5, 6, 7, 8, 9, 10], [OutputSpec(index=5, sample=greedy, dist=4)]),
        _req("b", b, 0, [40, 41, 42], [OutputSpec(index=2, sample=seeded)], mask=[[1], [2], [1, 1, 1]]),
        _req("c", c, 0, [99], [OutputSpec(index=0, dist=3)]),
    ]]
    for k in range(4):
        steps.append([_req("a", a, 6 + k, [11 + k], [OutputSpec(index=0, sample=greedy)]),
                      _req("b", b, 3 + k, [50 + k], [OutputSpec(index=0, sample=seeded, dist=2)])])
    return steps


def _plain(results):
    return [[(o.token, o.ids, [round(p, 5) for p in o.probs]) for o in r] for r in results]


def test_start_forward_equals_forward_step_for_step():
    a, b = tiny_backend(), tiny_backend()
    for batch in _batches():
        want = a.forward(batch)
        step = b.start_forward(batch)
        got = step.wait()
        assert _plain(got) == _plain(want)
        assert step.tokens == [r[0].token if r else None for r in want]
        assert step.wait() is got  # waiting twice gives the same outputs


def test_requests_are_read_at_the_call():
    a, b = tiny_backend(), tiny_backend()
    batch = _batches()[0]
    want = a.forward(batch)
    step = b.start_forward(batch)
    batch[0].tokens[0] = 200  # the caller prepares its next step at once (the scheduler does)
    batch[0].positions[0] = 77
    batch[1].outputs.clear()
    assert _plain(step.wait()) == _plain(want)


def test_calls_run_in_the_order_they_are_made():
    a, b = tiny_backend(), tiny_backend()
    batch = _batches()[0]
    read = ForwardRequest(pages=[7, 8], last_page_len=1, tokens=[3], positions=[4],
                          outputs=[OutputSpec(index=0, dist=5)])
    a.forward(batch)
    a.copy_tokens(0, 0, 7, 0, 4)
    want = a.forward([read])
    b.start_forward(batch)  # not waited for: the copy must still see its K/V
    b.copy_tokens(0, 0, 7, 0, 4)
    assert _plain(b.forward([read])) == _plain(want)
    assert _plain(b.start_forward([read]).wait()) == _plain(a.forward([read]))


def test_a_bad_request_fails_at_the_call_and_touches_nothing():
    b = tiny_backend()
    good = _batches()[0]
    bad = ForwardRequest(pages=[999], last_page_len=1, tokens=[1], positions=[0], name="bad")
    with pytest.raises(ForwardError, match="bad") as e:
        b.start_forward([good[0], bad])
    assert e.value.request_index == 1
    assert b.start_forward([]).wait() == []


def test_loops_run_ahead_on_the_real_backend_give_what_step_at_a_time_gives():
    ahead = _run(True, SPECS, backend=tiny_backend(page_size=PS))
    step = _run(False, SPECS, backend=tiny_backend(page_size=PS))
    assert ahead.results == step.results
    assert ahead.rows == step.rows
    assert ahead.streamed == step.streamed
    assert ahead.filled == step.filled and ahead.cached == step.cached
    assert ahead.free == step.free == 256
    # the random model draws other tokens than the stand-in: the loops really ran on it
    assert any(r[0] != tuple(range(sp.prompt[-1] + 1, sp.prompt[-1] + 1 + len(r[0])))
               for r, sp in zip(ahead.results.values(), SPECS, strict=True))


def test_fed_loops_on_the_real_backend_give_what_step_at_a_time_gives():
    """Each loop's step launched before the last one's token is read on the host (`Feed`, read by
    the model from the batch before): the same tokens, pages and cache views as step at a time."""
    free = _run(False, SPECS, backend=tiny_backend(page_size=PS))
    # stop tokens the model draws mid-way (from the free run), besides the stand-in's own specs
    # (no stop strings: a loop that cannot run ahead keeps the batches it is in from being fed)
    specs = [sp for sp in SPECS if not sp.stop_strings]
    specs += [replace(SPECS[k], stop=(free.results[f"loop{k}"][0][2],), max_tokens=12) for k in (0, 3, 4, 7)]
    fed = _run(True, specs, backend=tiny_backend(page_size=PS), fed=True)
    step = _run(False, specs, backend=tiny_backend(page_size=PS))
    assert fed.results == step.results
    assert fed.streamed == step.streamed
    assert fed.filled == step.filled and fed.cached == step.cached
    assert fed.free == step.free == 256
    assert any(len(fed.rows[n]) > len(r) for n, r in step.rows.items())  # a step was launched past a stop


def _reference_generate(be, prompts, max_tokens, sampler, stops):
    """One forward per step, each step's tokens read before the next is built (the plain loop)."""
    pages = [list(range(20 * i, 20 * i + 20)) for i in range(len(prompts))]
    seqs = [list(p) for p in prompts]
    outs = [[] for _ in prompts]
    live = list(range(len(prompts)))
    first = True
    while live:
        reqs = []
        for i in live:
            new = seqs[i] if first else seqs[i][-1:]
            reqs.append(_req(f"s{i}", pages[i], len(seqs[i]) - len(new), new,
                             [OutputSpec(index=len(new) - 1, sample=sampler)]))
        first = False
        res = be.forward(reqs)
        still = []
        for i, r in zip(live, res, strict=True):
            outs[i].append(r[0].token)
            seqs[i].append(r[0].token)
            if r[0].token not in stops and len(outs[i]) < max_tokens:
                still.append(i)
        live = still
    return outs


@pytest.mark.parametrize("sampler", [SamplerParams(), SamplerParams(temperature=1.0, seed=3)], ids=["greedy", "seeded"])
def test_generate_batch_feeding_steps_on_the_device_equals_the_plain_loop(sampler):
    prompts = [[5, 6, 7], [9], [30, 31, 32, 33, 34, 35, 36, 37, 38], [100, 101]]
    ref_be = tiny_backend()
    free = _reference_generate(ref_be, prompts, 12, sampler, set())
    # stop tokens drawn mid-way by some sequences (taken from the free run): they end early, their
    # speculative next step is dropped, and the others go on unchanged
    stops = {free[0][4], free[2][1]}
    want = _reference_generate(ref_be, prompts, 12, sampler, stops)
    assert any(len(w) < 12 for w in want) and any(len(w) == 12 for w in want)
    be = tiny_backend()
    pages = [list(range(20 * i, 20 * i + 20)) for i in range(len(prompts))]
    assert be.generate_batch(prompts, 12, sampler, stop_tokens=sorted(stops), pages=pages) == want
    be.feeds = False  # the wait-then-launch path (tensor parallel's)
    assert be.generate_batch(prompts, 12, sampler, stop_tokens=sorted(stops), pages=pages) == want


def test_a_feed_is_checked():
    from gpu_backend.backend import Feed

    be = tiny_backend()
    src = be.start_forward([_req("a", [0], 0, [1, 2], [OutputSpec(index=1, sample=SamplerParams())]),
                            _req("b", [1], 0, [3], [OutputSpec(index=0, dist=2)])])
    two = _req("x", [2], 0, [4, 5], [OutputSpec(index=1, sample=SamplerParams())])
    with pytest.raises(ValueError, match="not a one-token request"):
        be.start_forward([two], Feed(src, [0], [0]))
    one = _req("y", [0], 2, [0], [OutputSpec(index=0, sample=SamplerParams())])  # a continues
    with pytest.raises(ValueError, match="draws no token"):
        be.start_forward([one], Feed(src, [0], [1]))
    fed = be.start_forward([one], Feed(src, [0], [0]))
    src_tok = src.wait()[0][0].token
    # the fed step ran on the drawn token: same as a step given that token outright
    ref = tiny_backend()
    ref.forward([_req("a", [0], 0, [1, 2], [])])
    want = ref.forward([_req("y", [0], 2, [src_tok], [OutputSpec(index=0, sample=SamplerParams())])])
    assert fed.wait()[0][0].token == want[0][0].token
