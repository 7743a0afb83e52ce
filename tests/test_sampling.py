"""Samplers: filters restrict the support, seeds make draws independent of the batch."""

from __future__ import annotations

import pytest
import torch

from gpu_backend import ForwardRequest, OutputSpec, SamplerParams
from gpu_backend.sampling import Sampler

# probabilities 0.4, 0.3, 0.15, 0.1, 0.05 on tokens 7, 3, 9, 1, 5 of a 10-token vocabulary
PROBS = {7: 0.4, 3: 0.3, 9: 0.15, 1: 0.1, 5: 0.05}


def logits() -> torch.Tensor:
    x = torch.full((10,), -1e9)
    for t, p in PROBS.items():
        x[t] = torch.log(torch.tensor(p))
    return x


def support(params: SamplerParams, draws: int = 400) -> set[int]:
    s = Sampler(torch.device("cpu"), seed=1234)
    lg = logits().expand(draws, -1).contiguous()
    res = s(lg, [OutputSpec(index=0, sample=params)] * draws)
    return {r.token for r in res}


def test_temperature_one_covers_the_whole_support():
    assert support(SamplerParams(temperature=1.0)) == set(PROBS)


def test_greedy_is_argmax():
    assert support(SamplerParams(temperature=0.0), 10) == {7}


@pytest.mark.parametrize("k, allowed", [(1, {7}), (2, {7, 3}), (3, {7, 3, 9})])
def test_top_k(k, allowed):
    assert support(SamplerParams(temperature=1.0, top_k=k)) == allowed


@pytest.mark.parametrize("p, allowed", [(0.3, {7}), (0.5, {7, 3}), (0.8, {7, 3, 9}), (0.9, {7, 3, 9, 1})])
def test_top_p(p, allowed):
    # smallest prefix of the sorted distribution whose mass reaches p
    assert support(SamplerParams(temperature=1.0, top_p=p)) == allowed


@pytest.mark.parametrize("m, allowed", [(0.5, {7, 3}), (0.3, {7, 3, 9}), (0.2, {7, 3, 9, 1})])
def test_min_p(m, allowed):
    assert support(SamplerParams(temperature=1.0, min_p=m)) == allowed


def test_filters_combine():
    assert support(SamplerParams(temperature=1.0, top_k=3, top_p=0.5)) == {7, 3}


def test_low_temperature_concentrates():
    s = support(SamplerParams(temperature=0.01))  # p(3)/p(7) = (0.3/0.4)**100
    assert s == {7}


def test_frequencies_follow_probabilities():
    n = 4000
    s = Sampler(torch.device("cpu"), seed=7)
    res = s(logits().expand(n, -1).contiguous(), [OutputSpec(index=0, sample=SamplerParams(temperature=1.0))] * n)
    freq = sum(r.token == 7 for r in res) / n
    assert abs(freq - 0.4) < 0.04


def test_dist_returns_top_ids_and_probs():
    s = Sampler(torch.device("cpu"))
    (r,) = s(logits()[None], [OutputSpec(index=0, dist=3)])
    assert r.token is None and r.ids == [7, 3, 9]
    assert r.probs == pytest.approx([0.4, 0.3, 0.15], abs=1e-5)


def test_target_logprob_is_the_log_softmax_before_any_mask():
    """Issue 39 (prompt logprobs): a row's `target` comes back as log_softmax(logits)[target], the
    model's own distribution, whatever mask or sampler the row has; rows without one get None."""
    s = Sampler(torch.device("cpu"))
    x = torch.randn(3, 50)
    only_0 = (1).to_bytes(4, "little") + bytes(4 * 1)  # a mask allowing token 0 alone (50 tokens: 2 words)
    specs = [OutputSpec(index=0, target=7), OutputSpec(index=1, sample=SamplerParams(temperature=0.0)),
             OutputSpec(index=2, sample=SamplerParams(temperature=0.0), allowed=only_0, target=9)]
    r = s(x, specs)
    want = torch.log_softmax(x, -1)
    assert r[0].logprob == pytest.approx(want[0, 7].item(), abs=1e-6) and r[1].logprob is None
    assert r[2].token == 0 and r[2].logprob == pytest.approx(want[2, 9].item(), abs=1e-6)


def test_seed_reproducible_regardless_of_batch(backend):
    tok = backend.tokenizer
    ps = backend.info.page_size
    prompt = tok.encode("Write a short poem about the sea:")
    n = len(prompt)
    assert n <= 2 * ps
    seeded = SamplerParams(temperature=1.5, top_p=0.95, seed=42)

    def request(pages: list[int], sample: SamplerParams, name: str) -> ForwardRequest:
        used = -(-n // ps)
        return ForwardRequest(pages=pages[:used], last_page_len=n - (used - 1) * ps, tokens=prompt, positions=list(range(n)),
                              outputs=[OutputSpec(index=n - 1, sample=sample)], name=name)

    alone = backend.forward([request([500, 501], seeded, "alone")])[0][0].token
    others = [request([502 + 2 * i, 503 + 2 * i], SamplerParams(temperature=1.0), f"o{i}") for i in range(3)]
    for placement in range(3):
        batch = others[:placement] + [request([510, 511], seeded, "seeded")] + others[placement:]
        got = backend.forward(batch)[placement][0].token
        assert got == alone
    # without the seed, draws vary
    tokens = {backend.forward([request([500, 501], SamplerParams(temperature=1.5), "u")])[0][0].token
              for _ in range(12)}
    assert len(tokens) > 1
