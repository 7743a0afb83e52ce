"""Batched forward semantics on the real model: ragged batches, masks, page sizes, page boundaries."""

from __future__ import annotations

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


@pytest.fixture(scope="module")
def texts(backend):
    enc = backend.tokenizer.encode
    return {
        "a": enc("The quick brown fox jumps over the lazy dog."),
        "b": enc("In 1492, Columbus sailed the ocean blue; in 1969, humans walked on the Moon. Later,"),
        "c": enc("def add(a, b):\n    return a + b\n\nprint(add(2, 3))"),
    }


def test_ragged_batch_equals_each_alone(backend, texts):
    check_ragged_batch_equals_each_alone(backend, texts)


def test_decode_batch_equals_each_alone(backend, texts):
    ps = backend.info.page_size
    pg = Pages(backend, 100)
    seqs = [texts["a"], texts["b"], texts["c"]]
    alone = [backend.generate(s, 4, stop_tokens=[], pages=pg.take(8)) for s in seqs]
    together = backend.generate_batch(seqs, 4, stop_tokens=[], pages=[pg.take(8) for _ in seqs])
    assert together == alone
    assert ps == 16


def test_tree_mask_equals_separate_branches(backend, texts):
    check_tree_mask_equals_separate_branches(backend, texts)


def test_mask_hiding_a_token_equals_sequence_without_it(backend, texts):
    ps = backend.info.page_size
    seq, hide = texts["b"][:12], 4
    pg = Pages(backend, 300)
    without = seq[:hide] + seq[hide + 1:]
    pos_without = list(range(hide)) + list(range(hide + 1, len(seq)))
    nxt = texts["a"][0]
    # reference: the token is simply absent, positions of the others kept
    pr = pg.take(2)
    ref = backend.logits([req(pr, 0, without, ps, positions=pos_without)])[0]
    ref_dec = backend.logits([req(pr, len(without), [nxt], ps, positions=[len(seq)])])[0]
    # masked: prefill with the token present but hidden from later rows, then a masked decode step
    pm = pg.take(2)
    mask = [[i + 1] if i <= hide else [hide, 1, i - hide] for i in range(len(seq))]
    got = backend.logits([req(pm, 0, seq, ps, mask=mask)])[0]
    got_dec = backend.logits([req(pm, len(seq), [nxt], ps, mask=[[hide, 1, len(seq) - hide]])])[0]
    assert_close(got[:hide], ref[:hide], "rows before the hidden token")
    assert_close(got[hide + 1:], ref[hide:], "rows after the hidden token")
    assert_close(got_dec, ref_dec, "masked decode step")


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 32])
def test_page_sizes_agree(backend, texts, page_size):
    other = with_page_size(backend, page_size, 4096 // page_size)
    seqs = [texts["a"], texts["b"], texts["c"]]
    steps = 5
    ref = backend.generate_batch(seqs, steps, stop_tokens=[], pages=[list(range(400 + 8 * i, 408 + 8 * i))
                                                                     for i in range(3)])
    got = other.generate_batch(seqs, steps, stop_tokens=[])
    assert got == ref
    # logits of a ragged prefill agree as well
    ps = other.info.page_size
    pg = Pages(other, 0)
    lg = other.logits([req(pg.take(64 // ps + 1), 0, s, ps) for s in seqs])
    ref_lg = backend.logits([req(list(range(430 + 4 * i, 434 + 4 * i)), 0, s, 16) for i, s in enumerate(seqs)])
    for x, y in zip(lg, ref_lg, strict=True):
        assert_close(x, y, f"page size {page_size}")


def test_last_page_exactly_full_then_new_page(backend, texts):
    ps = backend.info.page_size
    seq = (texts["b"] * 2)[: ps + 1]  # 16 tokens fill page 0 exactly, the 17th opens page 1
    pg = Pages(backend, 450)
    one_pass = backend.logits([req(pg.take(2), 0, seq, ps)])[0]
    pages = pg.take(2)
    full = backend.logits([req(pages, 0, seq[:ps], ps)])[0]
    assert full.shape[0] == ps
    nxt = backend.logits([req(pages, ps, seq[ps:], ps)])[0]
    assert_close(torch.cat([full, nxt]), one_pass, "page boundary")


def test_fresh_single_token_sequence(backend):
    pg = Pages(backend, 460)
    bos = backend.tokenizer.encode("<|im_start|>")
    assert len(bos) == 1
    a = backend.logits([req(pg.take(1), 0, bos, backend.info.page_size)])[0]
    b = backend.logits([req(pg.take(1), 0, bos, backend.info.page_size)])[0]
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_copy_tokens_moves_kv(backend, texts):
    ps = backend.info.page_size
    seq = texts["b"][:20]
    pg = Pages(backend, 470)
    src, dst = pg.take(2), pg.take(2)
    backend.logits([req(src, 0, seq, ps, outputs=[])])
    backend.copy_tokens(src[0], 0, dst[0], 0, ps)
    backend.copy_tokens(src[1], 0, dst[1], 0, len(seq) - ps)
    nxt = [texts["a"][0]]
    a = backend.logits([req(src, len(seq), nxt, ps)])[0]
    b = backend.logits([req(dst, len(seq), nxt, ps)])[0]
    assert torch.equal(a, b)


def test_generate_answers_the_question(backend):
    tok = backend.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = backend.generate(prompt, 16, pages=list(range(480, 484)))
    assert "Paris" in tok.decode(out)
    assert out[-1] in backend.info.stop_tokens
