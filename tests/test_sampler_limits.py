"""Sampler values at their limits: each one either works or is refused at validation, and a hostile
row never changes, or fails, the other rows of its batch.

The fast tests drive `gpu_backend.sampling.Sampler` on synthetic logits (real-model magnitudes,
ties, -inf entries); the slow one runs batches on the real model.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpu_backend import ForwardRequest, OutputSpec, SamplerParams
from gpu_backend import sampling as sampling_mod
from gpu_backend.sampling import Sampler
from gpu_backend.validate import as_sampler

V = 50
F32_TINY, F32_MAX = 1.1754943508222875e-38, 3.4028234663852886e38
CPU = torch.device("cpu")


def model_like_logits(seed: int = 0, scale: float = 4.0, offset: float = 25.0) -> torch.Tensor:
    """A [V] row like a real model's: values around 25, one clear maximum at token 17."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=g) * scale + offset
    x[17] = x.max() + 3.0
    return x


# Each value passes validation; before the fix each one crashed the whole batch (NaN, a draw at
# index -1, or an int64 overflow) or was wrongly refused.
EFFECTIVELY_GREEDY = {  # the draw must be the argmax
    "temperature=1e-45": SamplerParams(temperature=1e-45),
    "temperature=5e-324": SamplerParams(temperature=5e-324),
    "temperature=1e-300": SamplerParams(temperature=1e-300),
    "temperature=1e-40 (f32 subnormal)": SamplerParams(temperature=1e-40),
    "temperature=1e-38": SamplerParams(temperature=1e-38),
    "top_p=1e-50 (0 in f32)": SamplerParams(temperature=1.0, top_p=1e-50),
    "top_p=5e-324": SamplerParams(temperature=1.0, top_p=5e-324),
    "top_p=1e-45": SamplerParams(temperature=1.0, top_p=1e-45),
    "min_p=1": SamplerParams(temperature=1.0, min_p=1.0),
    "top_k=1": SamplerParams(temperature=1.0, top_k=1),
    "all filters at their limits": SamplerParams(temperature=1e-45, top_k=2**64, top_p=1e-50, min_p=1.0,
                                                 seed=2**64 - 1),
}
ANY_TOKEN = {  # any token of the row is a sensible draw
    "temperature=1e38": SamplerParams(temperature=1e38),
    "temperature=f32 max": SamplerParams(temperature=F32_MAX),
    "temperature=1e300 (inf in f32)": SamplerParams(temperature=1e300),
    "temperature=f64 max": SamplerParams(temperature=1.7976931348623157e308),
    "top_k=vocab": SamplerParams(temperature=1.0, top_k=V),
    "top_k=vocab+1": SamplerParams(temperature=1.0, top_k=V + 1),
    "top_k=2**32-1": SamplerParams(temperature=1.0, top_k=2**32 - 1),
    "top_k=2**63": SamplerParams(temperature=1.0, top_k=2**63),
    "top_k=10**30": SamplerParams(temperature=1.0, top_k=10**30),
    "top_p=1": SamplerParams(temperature=1.0, top_p=1.0),
    "min_p=5e-324": SamplerParams(temperature=1.0, min_p=5e-324),
    "min_p=1-1e-16": SamplerParams(temperature=1.0, min_p=1 - 1e-16),
    "seed=2**63": SamplerParams(temperature=1.0, seed=2**63),
    "seed=2**64-1": SamplerParams(temperature=1.0, seed=2**64 - 1),
    "huge temperature, min_p=1": SamplerParams(temperature=1e300, min_p=1.0, seed=0),
}
HOSTILE = {**EFFECTIVELY_GREEDY, **ANY_TOKEN}


def sample_with_greedy_neighbours(row: torch.Tensor, params: SamplerParams, dist: int = V) -> list:
    """Sample `row` with `params` between two greedy rows; return the three results."""
    other = model_like_logits(seed=99)
    logits = torch.stack([other, row, other])
    specs = [OutputSpec(0, sample=SamplerParams(), dist=3), OutputSpec(0, sample=as_sampler(params, "test"), dist=dist),
             OutputSpec(0, sample=SamplerParams())]
    res = Sampler(CPU, seed=5)(logits, specs)
    greedy = int(other.argmax())
    assert res[0].token == greedy and res[2].token == greedy
    assert res[0].ids[0] == greedy and all(math.isfinite(p) for p in res[0].probs)
    return res


@pytest.mark.parametrize("params", list(EFFECTIVELY_GREEDY.values()), ids=list(EFFECTIVELY_GREEDY))
def test_effectively_greedy_values_draw_the_argmax(params):
    for row in (model_like_logits(), model_like_logits(scale=1e6, offset=0.0)):
        res = sample_with_greedy_neighbours(row, params)
        assert res[1].token == int(row.argmax())


@pytest.mark.parametrize("params", list(ANY_TOKEN.values()), ids=list(ANY_TOKEN))
def test_limit_values_draw_a_token_of_the_row(params):
    row = model_like_logits()
    row[3] = -math.inf  # a token that can never be drawn
    for _ in range(5):
        res = sample_with_greedy_neighbours(row, params)
        assert 0 <= res[1].token < V and res[1].token != 3
        assert len(res[1].ids) == V and all(math.isfinite(p) for p in res[1].probs)


def test_tiny_temperature_splits_exact_ties_only():
    row = model_like_logits()
    row[30] = row[17]  # two exact maxima
    n = 60
    res = Sampler(CPU, seed=2)(row.expand(n, -1).contiguous(), [OutputSpec(0, sample=SamplerParams(temperature=1e-45))] * n)
    assert {r.token for r in res} == {17, 30}


def test_huge_temperature_is_uniform():
    n = 2000
    res = Sampler(CPU, seed=3)(model_like_logits().expand(n, -1).contiguous(),
                               [OutputSpec(0, sample=SamplerParams(temperature=1e300))] * n)
    counts = torch.bincount(torch.tensor([r.token for r in res]), minlength=V)
    assert int(counts.min()) > 10  # n / V = 40 per token


def test_top_k_past_the_vocabulary_is_no_filter():
    n = 400
    lg = model_like_logits(scale=0.1).expand(n, -1).contiguous()
    for k in (V + 1, 2**63, 10**30):
        res = Sampler(CPU, seed=4)(lg, [OutputSpec(0, sample=SamplerParams(temperature=1.0, top_k=k))] * n)
        assert len({r.token for r in res}) > V // 2


@pytest.mark.parametrize("seed", [0, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1])
def test_u64_seeds_are_accepted_and_reproducible(seed):
    params = as_sampler(SamplerParams(temperature=1.0, seed=seed), "test")
    row = model_like_logits(scale=0.1)  # near uniform: the draw depends on the seed
    first = sample_with_greedy_neighbours(row, params)[1].token
    for placement in range(3):
        rows = [model_like_logits(seed=i) for i in range(3)]
        rows.insert(placement, row)
        specs = [OutputSpec(0, sample=SamplerParams(temperature=1.0))] * 4
        specs[placement] = OutputSpec(0, sample=params)
        assert Sampler(CPU)(torch.stack(rows), specs)[placement].token == first


def test_seeds_differing_only_in_high_bits_draw_differently():
    row = torch.zeros(1000)  # uniform over 1000 tokens
    params = [SamplerParams(temperature=1.0, seed=s + hi) for s in range(20) for hi in (0, 2**32, 2**63)]
    res = Sampler(CPU)(row.expand(len(params), -1).contiguous(), [OutputSpec(0, sample=p) for p in params])
    triples = [tuple(r.token for r in res[i: i + 3]) for i in range(0, len(res), 3)]
    assert sum(len(set(t)) < 3 for t in triples) <= 2


def test_seeded_draws_follow_the_distribution():
    n = 3000
    lg = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    res = Sampler(CPU)(lg.expand(n, -1).contiguous(),
                       [OutputSpec(0, sample=SamplerParams(temperature=1.0, seed=2**64 - 1 - s)) for s in range(n)])
    freq = torch.bincount(torch.tensor([r.token for r in res]), minlength=3) / n
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


@pytest.mark.parametrize(
    "params, message",
    [
        (dict(temperature=10**400), "test: temperature must be a finite number >= 0, got 1000000000"),
        (dict(temperature=math.nan), "test: temperature must be a finite number >= 0, got nan"),
        (dict(temperature=math.inf), "test: temperature must be a finite number >= 0, got inf"),
        (dict(temperature=-1e-45), "test: temperature must be a finite number >= 0, got -1e-45"),
        (dict(top_p=0.0), "test: top_p must be in (0, 1], got 0.0"),
        (dict(top_p=math.nan), "test: top_p must be in (0, 1], got nan"),
        (dict(min_p=math.nan), "test: min_p must be in [0, 1], got nan"),
        (dict(min_p=1 + 1e-15), "test: min_p must be in [0, 1], got 1.000000000000001"),
        (dict(top_k=-1), "test: top_k must be an int >= 0 (0 = off), got -1"),
        (dict(seed=2**64), "test: seed must be None or an int in [0, 2**64) (a u64), got 18446744073709551616"),
        (dict(seed=-1), "test: seed must be None or an int in [0, 2**64) (a u64), got -1"),
    ],
)
def test_out_of_range_values_are_refused_naming_them(params, message):
    with pytest.raises(ValueError) as exc:
        as_sampler(params, "test")
    assert str(exc.value).startswith(message)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_logits_row_fails_alone_naming_its_row(bad):
    logits = torch.stack([model_like_logits(1), model_like_logits(2), model_like_logits(3)])
    if bad == -math.inf:
        logits[1] = bad  # every token masked: nothing to draw
    else:
        logits[1, 7] = bad
    specs = [OutputSpec(0, sample=SamplerParams(temperature=1.0, seed=1)),
             OutputSpec(0, sample=SamplerParams(temperature=0.5)), OutputSpec(0, dist=4)]
    with pytest.raises(sampling_mod.SampleError, match="output row 1: logits are not finite") as exc:
        Sampler(CPU)(logits, specs)
    assert exc.value.row == 1


# -- property: every accepted SamplerParams gives a token of the row and finite probabilities -------

BOUNDARY_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1.4e-45, 1e-40, F32_TINY, 1e-30, 1e-8, 0.5, 1.0, 1 - 1e-16,
                   1 + 1e-16, 2.0, 1e30, F32_MAX, 1e300, 1.7976931348623157e308]
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(BOUNDARY_FLOATS) | st.integers(-1, 10**400)
INTS = st.integers(-1, 2**70) | st.sampled_from([0, 1, V - 1, V, V + 1, 2**31, 2**32 - 1, 2**63 - 1, 2**63, 2**64])
SEEDS = st.none() | st.integers(-1, 2**65) | st.sampled_from([0, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1,
                                                             2**64])
PARAMS = st.builds(SamplerParams, temperature=FLOATS, top_k=INTS, top_p=FLOATS, min_p=FLOATS, seed=SEEDS)


@st.composite
def logit_rows(draw: st.DrawFn) -> torch.Tensor:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
    scale = draw(st.sampled_from([0.0, 1e-6, 1.0, 30.0, 1e4, 1e30, 1e38]))
    row = (torch.randn(V, generator=g) * scale + draw(st.sampled_from([0.0, 25.0, -1e9]))).clamp(-F32_MAX, F32_MAX)
    masked = draw(st.lists(st.integers(0, V - 1), max_size=V - 1, unique=True))
    row[masked] = -math.inf
    return row


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=PARAMS, row=logit_rows())
def test_every_accepted_sampler_draws_a_token_of_the_row(params, row):
    try:
        checked = as_sampler(params, "prop")
    except ValueError as e:  # refused: the message names the parameter
        assert str(e).startswith("prop: ") and any(f in str(e) for f in ("temperature", "top_k", "top_p", "min_p",
                                                                          "seed")), str(e)
        return
    res = sample_with_greedy_neighbours(row, checked)
    assert 0 <= res[1].token < V and row[res[1].token] > -math.inf
    assert all(math.isfinite(p) and 0 <= p <= 1 for p in res[1].probs)


# -- end to end on the real model -------------------------------------------------------------------

PROMPTS = ["The capital of France is", "One, two, three, four,", "def add(a, b):", "The sea was calm and"]


@pytest.fixture(scope="module")
def alone(backend):
    """Each prompt's greedy token, run alone (prompt i on page 1200 + i)."""
    reqs = [request(backend, i, SamplerParams()) for i in range(len(PROMPTS))]
    return [backend.forward([r])[0][0].token for r in reqs]


def request(backend, i: int, params: SamplerParams, dist: int = 0) -> ForwardRequest:
    ids = backend.tokenizer.encode(PROMPTS[i])
    n = len(ids)
    assert n <= backend.info.page_size
    return ForwardRequest(pages=[1200 + i], last_page_len=n, tokens=ids, positions=list(range(n)),
                          outputs=[OutputSpec(index=n - 1, sample=params, dist=dist)], name=f"r{i}")


@pytest.mark.parametrize("params", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_sampler_leaves_the_rest_of_its_batch_alone(backend, alone, params):
    vocab = backend.info.vocab_size
    hostile = 1
    batch = [request(backend, i, SamplerParams()) for i in range(len(PROMPTS))]
    batch[hostile] = request(backend, hostile, params, dist=vocab)
    out = backend.forward(batch)
    for i, res in enumerate(out):
        if i != hostile:
            assert res[0].token == alone[i]
    got = out[hostile][0]
    assert got.token is not None and 0 <= got.token < vocab
    assert len(got.ids) == vocab and all(math.isfinite(p) for p in got.probs)
    if params in EFFECTIVELY_GREEDY.values():
        assert got.token == alone[hostile]
