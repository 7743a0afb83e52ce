"""FlexAttention (pages read in place) against SDPA (pages gathered) on the real model, CPU fp32.

Every scenario runs the same calls on two backends that share the model, one per attention path,
each with its own small cache, and compares every logits row (TOL, same top-1). flex_attention is
compiled here, as users get it, except that batches of 1 to 3 share the batch-4 kernel
(`min_batch=4`): the first tests of each page size pay four compiles of ~4 s each (causal / BRLE
x decode / prefill buckets, see gpu_backend/attention/flex.py) instead of six; later tests reuse them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from backend_checks import (
    Pages,
    assert_close,
    check_ragged_batch_equals_each_alone,
    check_tree_mask_equals_separate_branches,
    req,
    with_page_size,
)

from gpu_backend import ForwardRequest
from gpu_backend.attention import brle_row, build_plan
from gpu_backend.attention.flex import Q_BLOCK, FlexAttention

CACHE_SLOTS = 2048  # small caches: flex addresses the whole cache


class Recording:
    """A backend stand-in that forwards `logits` calls and keeps what they returned."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.info = inner.info
        self.tokenizer = inner.tokenizer
        self.seen: list[list[torch.Tensor]] = []

    def logits(self, reqs):
        out = self.inner.logits(reqs)
        self.seen.append(out)
        return out


def random_batch(rng: np.random.Generator, ps: int, num_pages: int, masked: bool) -> list[ForwardRequest]:
    """Three requests on disjoint shuffled pages, contexts of 0..40, 1..200 new tokens (two row
    tiles), with BRLE rows hiding random runs if `masked`."""
    free = list(rng.permutation(num_pages))
    reqs = []
    for _ in range(3):
        ctx, n = int(rng.integers(0, 41)), int(rng.integers(1, 201))
        total = ctx + n
        pages = [int(free.pop()) for _ in range(-(-total // ps))]
        mask = None
        if masked:
            mask = []
            for t in range(n):
                row = rng.random(ctx + t + 1) < 0.7
                row[0] = True  # a BRLE row starts with an attend run
                edges = np.flatnonzero(np.diff(row.astype(np.int8))) + 1
                mask.append(np.diff(np.concatenate([[0], edges, [len(row)]])).tolist())
        reqs.append(ForwardRequest(pages=pages, last_page_len=total - (len(pages) - 1) * ps, tokens=[1] * n,
                                   positions=list(range(ctx, total)), mask=mask))
    return reqs


@pytest.mark.parametrize("window", [0, 37], ids=["global", "window"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "brle"])
@pytest.mark.parametrize("ps", [1, 4, 16])
def test_page_lists_cover_what_the_rows_see(ps, masked, window):
    # every (row, slot) a request's row attends to lies on a listed page, and a page listed as full
    # is seen whole by every real row of the tile (causal: the lists are exact); with a window, the
    # sliding layers' lists do the same for the rows' windows
    rng = np.random.default_rng(ps + 100 * masked)
    num_pages = 1024 // ps
    reqs = random_batch(rng, ps, num_pages, masked)
    meta = build_plan(reqs, ps, torch.device("cpu"), 3, FlexAttention(), num_pages=num_pages, window=window).meta
    blocks = meta.local if window else meta.blocks
    assert blocks is not None
    for b, r in enumerate(reqs):
        ctx, n = r.context_len(ps), len(r.tokens)
        seen = np.zeros((n, len(r.pages) * ps), dtype=bool)
        for t in range(n):
            seen[t, : ctx + t + 1] = True if r.mask is None else brle_row(r.mask[t])
            if window:
                seen[t, : max(0, ctx + t + 1 - window)] = False
        for q in range(-(-n // Q_BLOCK)):
            rows = seen[q * Q_BLOCK : (q + 1) * Q_BLOCK].reshape(-1, len(r.pages), ps)
            any_, all_ = rows.any(axis=(0, 2)), rows.all(axis=(0, 2))
            part = set(blocks.kv_idx[b, 0, q, : blocks.kv_num[b, 0, q]].tolist())
            full = set(blocks.full_idx[b, 0, q, : blocks.full_num[b, 0, q]].tolist())
            want_any = {p for p, x in zip(r.pages, any_, strict=True) if x}
            want_all = {p for p, x in zip(r.pages, all_, strict=True) if x}
            assert not part & full
            assert want_any <= part | full and full <= want_all, f"request {b}, tile {q}"
            if not masked:
                assert part | full == want_any and full == want_all, f"request {b}, tile {q}"


@pytest.fixture(scope="module")
def texts(backend):
    enc = backend.tokenizer.encode
    return {
        "a": enc("The quick brown fox jumps over the lazy dog."),
        "b": enc("In 1492, Columbus sailed the ocean blue; in 1969, humans walked on the Moon. Later,"),
        "c": enc("def add(a, b):\n    return a + b\n\nprint(add(2, 3))"),
    }


@pytest.fixture(scope="module", params=[1, 16, 32], ids=lambda ps: f"page{ps}")
def pair(backend, request):
    """(sdpa, flex) backends over the session's model with `page_size` pages, fresh caches."""
    ps = request.param
    n = CACHE_SLOTS // ps
    return with_page_size(backend, ps, n), with_page_size(backend, ps, n, FlexAttention(min_batch=4))


def same_calls(pair, scenario) -> None:
    """Run `scenario(backend)` on both paths; every logits row of every call must agree."""
    sdpa, flex = Recording(pair[0]), Recording(pair[1])
    scenario(sdpa)
    scenario(flex)
    assert len(sdpa.seen) == len(flex.seen)
    for i, (xs, ys) in enumerate(zip(sdpa.seen, flex.seen, strict=True)):
        for j, (x, y) in enumerate(zip(xs, ys, strict=True)):
            if x.numel():
                assert_close(y, x, f"call {i}, request {j}")


def test_ragged_prefill_and_continuation(pair, texts):
    # prefills of different lengths alone and in one batch with a continuation over cached context
    same_calls(pair, lambda be: check_ragged_batch_equals_each_alone(be, texts))


def test_decode_batch(pair, texts):
    def scenario(be):
        ps = be.info.page_size
        pg = Pages(be)
        seqs = [texts["a"], texts["b"], texts["c"]]
        pages = [pg.for_tokens(64) for _ in seqs]
        be.logits([req(p, 0, s, ps, outputs=[]) for p, s in zip(pages, seqs, strict=True)])
        lens = [len(s) for s in seqs]
        for step in range(3):  # ragged contexts, one token each
            nxt = [texts["a"][step + i] for i in range(len(seqs))]
            be.logits([req(p, n, [t], ps) for p, n, t in zip(pages, lens, nxt, strict=True)])
            lens = [n + 1 for n in lens]

    same_calls(pair, scenario)


def test_decode_tokens_equal(pair, texts):
    sdpa, flex = pair
    seqs = [texts["a"], texts["b"], texts["c"]]
    assert flex.generate_batch(seqs, 4, stop_tokens=[]) == sdpa.generate_batch(seqs, 4, stop_tokens=[])


def test_mixed_batch(pair, texts):
    # one batch: a fresh prefill, a decode step, a multi-token continuation and a masked decode step
    def scenario(be):
        ps = be.info.page_size
        pg = Pages(be)
        a, b, c = texts["a"], texts["b"], texts["c"]
        pa, pb, pc, pd = (pg.for_tokens(64) for _ in range(4))
        be.logits([req(pb, 0, b, ps, outputs=[]), req(pc, 0, c[:-4], ps, outputs=[]),
                   req(pd, 0, a, ps, outputs=[])])
        hide = [[3, 2, len(a) - 4]]  # the decode row of request d skips tokens 3 and 4
        be.logits([req(pa, 0, a, ps), req(pb, len(b), [a[0]], ps), req(pc, len(c) - 4, c[-4:], ps),
                   req(pd, len(a), [b[0]], ps, mask=hide)])

    same_calls(pair, scenario)


def test_tree_mask(pair, texts):
    # two branches over a shared prefix in one pass (BRLE rows), against flex and SDPA alike
    same_calls(pair, lambda be: check_tree_mask_equals_separate_branches(be, texts, first_page=0))


def test_mask_hiding_a_token(pair, texts):
    def scenario(be):
        ps = be.info.page_size
        seq, hide = texts["b"][:12], 4
        pm = Pages(be).for_tokens(32)
        mask = [[i + 1] if i <= hide else [hide, 1, i - hide] for i in range(len(seq))]
        be.logits([req(pm, 0, seq, ps, mask=mask)])
        be.logits([req(pm, len(seq), [texts["a"][0]], ps, mask=[[hide, 1, len(seq) - hide]])])

    same_calls(pair, scenario)


def test_eager_flex_matches(backend, texts):
    # the uncompiled path (a debugging aid): the same mask_mod decides alone, block lists unused
    ps = 16
    sdpa = with_page_size(backend, ps, 512 // ps)
    flex = with_page_size(backend, ps, 512 // ps, FlexAttention(compile=False))
    seq, hide = texts["b"][:12], 4
    mask = [[i + 1] if i <= hide else [hide, 1, i - hide] for i in range(len(seq))]
    batch = [req([0, 1], 0, seq, ps, mask=mask), req([2, 3], 0, texts["a"], ps)]
    for i, (x, y) in enumerate(zip(sdpa.logits(batch), flex.logits(batch), strict=True)):
        assert_close(y, x, f"request {i}")
