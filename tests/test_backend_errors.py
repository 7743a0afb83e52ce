"""Every invalid request is rejected with a message naming the request and the bad value."""

from __future__ import annotations

import math

import pytest

from gpu_backend import ForwardError, ForwardRequest, OutputSpec, SamplerParams


def good(**kw) -> ForwardRequest:
    base = dict(pages=[0, 1], last_page_len=4, tokens=[10, 11, 12], positions=[17, 18, 19],
                outputs=[OutputSpec(index=2, sample=SamplerParams())], name="inst-7")
    base.update(kw)
    return ForwardRequest(**base)


@pytest.mark.parametrize(
    "kw, expected",
    [
        (dict(pages=[0, 99999]), "page index 99999 out of range"),
        (dict(pages=[-1, 1]), "page index -1 out of range"),
        (dict(pages=[1, 1]), "repeats a page"),
        (dict(pages=[]), "no pages"),
        (dict(last_page_len=0), "last_page_len 0 out of range"),
        (dict(last_page_len=17), "last_page_len 17 out of range"),
        (dict(pages=[0], last_page_len=2), "3 new tokens but the pages hold only 2"),
        (dict(tokens=[]), "no tokens"),
        (dict(tokens=[10, 11, 10**9]), "token 1000000000 out of range"),
        (dict(positions=[1, 2]), "2 positions for 3 tokens"),
        (dict(positions=[1, 2, -3]), "position -3 out of range"),
        (dict(mask=[[18], [19]]), "2 mask rows for 3 tokens"),
        (dict(mask=[[18], [19], [21]]), "mask row 2 covers 21 tokens, expected 20"),
        (dict(mask=[[18], [19], [0, 20]]), "mask row 2 attends to no token"),
        (dict(mask=[[18], [19], [10, -1, 11]]), "negative or non-int run length"),
        (dict(outputs=[OutputSpec(index=3)]), "output index 3 out of range"),
        (dict(outputs=[OutputSpec(index=0, dist=-1)]), "dist -1 out of range"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(temperature=-0.5))]), "temperature must be"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(top_p=0.0))]), "top_p must be in (0, 1]"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(top_p=1.5))]), "top_p must be in (0, 1]"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(top_k=-1))]), "top_k must be an int >= 0"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(min_p=2.0))]), "min_p must be in [0, 1]"),
        (dict(outputs=[OutputSpec(index=0, dist=10**6)]), "output 0 dist 1000000 out of range"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(temperature=math.nan))]), "temperature must be"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(temperature=10**400))]), "temperature must be"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(top_p=math.nan))]), "top_p must be in (0, 1]"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(seed=-5))]), "seed must be None or an int in [0, 2**64)"),
        (dict(outputs=[OutputSpec(index=0, sample=SamplerParams(seed=2**64))]), "seed must be None or an int in [0, 2**64)"),
        (dict(outputs=[OutputSpec(index=0, sample={"temperature": 1.0, "top_q": 3})]), "unknown sampler parameter"),
    ],
)
def test_invalid_request_rejected(backend, kw, expected):
    bad = good(**kw)
    with pytest.raises(ValueError, match="inst-7") as exc:
        backend.check_request(bad)
    assert expected in str(exc.value)
    with pytest.raises(ForwardError) as fe:
        backend.forward([good(pages=[5, 6]), bad])
    assert fe.value.request_index == 1 and expected in str(fe.value)


def test_valid_request_and_sampler_mapping_accepted(backend):
    backend.check_request(good())
    backend.check_request(good(outputs=[OutputSpec(index=1, sample={"temperature": 0.7, "top_k": 5})]))
    backend.check_request(good(mask=[[18], [19], [10, 1, 9]]))
    vocab = backend.info.vocab_size
    limits = SamplerParams(temperature=5e-324, top_k=2**64, top_p=5e-324, min_p=1.0, seed=2**64 - 1)
    backend.check_request(good(outputs=[OutputSpec(index=0, sample=limits, dist=vocab)]))


def test_two_requests_writing_the_same_slot_rejected(backend):
    with pytest.raises(ForwardError, match="also written by an earlier request") as fe:
        backend.forward([good(pages=[8, 9], name="x"), good(pages=[10, 9], name="y")])
    assert fe.value.request_index == 1


def test_copy_tokens_errors(backend):
    ps, n = backend.info.page_size, backend.info.num_pages
    with pytest.raises(ValueError, match=f"src_page {n} out of range"):
        backend.copy_tokens(n, 0, 0, 0, 1)
    with pytest.raises(ValueError, match="dst_offset 10 \\+ count 8 exceeds page size"):
        backend.copy_tokens(0, 0, 1, 10, 8)
    with pytest.raises(ValueError, match="count -1"):
        backend.copy_tokens(0, 0, 1, 0, -1)
    backend.copy_tokens(0, 0, 1, 0, ps)


def test_non_finite_logits_fail_only_their_request(backend, monkeypatch):
    forward = backend.model.forward

    def poisoned(plan, cache):  # the second request's rows (outputs 1 and 2 of the batch) are NaN
        logits = forward(plan, cache)
        logits[1:3] = float("nan")
        return logits

    two_outputs = [OutputSpec(index=1, sample=SamplerParams(temperature=1.0)), OutputSpec(index=2, dist=3)]
    batch = [good(pages=[20, 21], name="a"), good(pages=[22, 23], outputs=two_outputs, name="b"),
             good(pages=[24, 25], name="c")]
    monkeypatch.setattr(backend.model, "forward", poisoned)
    with pytest.raises(ForwardError, match="forward request 'b': output 0: logits are not finite") as fe:
        backend.forward(batch)
    assert fe.value.request_index == 1
