"""`TorchBackend.start_forward` (the real backend overlapping the host) against `forward`, on CPU: the
batch runs on the backend's worker thread. Same outputs, token for token; requests read at the
call; calls run in the order they are made; bad requests fail at the call; and the scheduler's
loops run ahead on it give what they give one step at a time. On CUDA the kit runs the same
checks (tests/test_backend_gpu.py)."""

from __future__ import annotations

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
