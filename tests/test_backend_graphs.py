"""Decode through CUDA graphs (gpu_backend/cuda_graphs.py): buckets, padding and refill on CPU,
graphs on == graphs off on CUDA (skipped without it).

On CPU, `DecodeGraphs(capture=False)` runs the forward on the static buffers a graph would be
captured on, refilled for each batch exactly as before a replay: everything but the capture itself.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from backend_checks import Pages, assert_close, req, tiny_backend

from gpu_backend import ForwardRequest, OutputSpec, TorchBackend, load_backend
from gpu_backend.attention import Attention, SdpaAttention, build_plan
from gpu_backend.attention.flex import FlexAttention
from gpu_backend.cuda_graphs import DecodeGraphs, bucket_for, pad_batch, refill
from gpu_backend.kv_cache import KVCache


def test_bucket_for_picks_the_smallest_bucket_that_fits():
    buckets = (1, 2, 4, 8)
    assert [bucket_for(n, buckets) for n in range(1, 10)] == [1, 2, 4, 4, 8, 8, 8, 8, None]


def test_pad_batch_adds_dummies_on_the_scratch_page():
    real = [ForwardRequest(pages=[3], last_page_len=5, tokens=[7], positions=[4], outputs=[OutputSpec(index=0)])]
    padded = pad_batch(real, 4, scratch_page=99)
    assert padded[0] is real[0] and len(padded) == 4
    for d in padded[1:]:
        assert d.pages == [99] and d.last_page_len == 1 and len(d.tokens) == 1 and d.outputs == [] and d.checked
        assert d.context_len(16) == 0  # writes slot 0 of the scratch page, attends to it alone


def test_refill_copies_into_the_static_buffers_and_rejects_other_shapes():
    def decode(lens: list[int]) -> list[ForwardRequest]:
        return [ForwardRequest(pages=[i], last_page_len=n, tokens=[5 + i], positions=[n - 1]) for i, n in enumerate(lens)]

    cpu = torch.device("cpu")
    attn = SdpaAttention()
    static = build_plan(decode([1, 1]), 16, cpu, 3, attn, num_pages=4, kv_slots=64, static=True, all_rows=True)
    new = build_plan(decode([9, 3]), 16, cpu, 3, attn, num_pages=4, kv_slots=64, static=True, all_rows=True)
    refill(static, new)
    assert torch.equal(static.tokens, new.tokens) and torch.equal(static.write_slots, new.write_slots)
    assert torch.equal(static.meta.gather, new.meta.gather) and torch.equal(static.meta.mask, new.meta.mask)
    longer = build_plan(decode([1, 1]), 16, cpu, 3, attn, num_pages=4, kv_slots=128, static=True, all_rows=True)
    with pytest.raises(RuntimeError, match="meta.gather has shape"):
        refill(static, longer)


def test_graphs_need_cuda():
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        load_backend(device="cpu", cuda_graphs=True, progress=False)


# 127 + the scratch page = 128 pages of 16, the cache size of test_backend_flex.py: flex compiles
# one kernel per cache size on CPU, so the same size reuses its kernels when both modules run
PAGES = 127


def with_graphs(backend: TorchBackend, attention: Attention, buckets: tuple[int, ...], capture: bool,
                num_pages: int = PAGES) -> TorchBackend:
    """Same model, a fresh cache of `num_pages` pages plus the scratch page graphs pad with."""
    m = backend.model
    cache = KVCache(m.cfg, backend.info.page_size, num_pages + 1, m.device, m.dtype)
    graphs = DecodeGraphs(m, cache, attention, backend.info.page_size, scratch_page=num_pages, buckets=buckets,
                          capture=capture)
    return TorchBackend(m, backend.tokenizer, replace(backend.info, num_pages=num_pages), cache, attention, graphs)


def prompts(backend: TorchBackend, n: int) -> list[list[int]]:
    enc = backend.tokenizer.encode
    texts = ["The quick brown fox jumps over the lazy dog.", "In 1492, Columbus sailed the ocean blue.",
             "def add(a, b):\n    return a + b", "Why is the sky blue?", "Write a haiku about rain."]
    return [enc(texts[i % len(texts)])[: 6 + 2 * i] for i in range(n)]


def eager_of(backend: TorchBackend, attention: Attention, num_pages: int = PAGES + 1) -> TorchBackend:
    m = backend.model
    cache = KVCache(m.cfg, backend.info.page_size, num_pages, m.device, m.dtype)
    return TorchBackend(m, backend.tokenizer, replace(backend.info, num_pages=num_pages), cache, attention)


@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_static_buffer_path_equals_eager_on_cpu(backend, attention):
    # 3 requests run in bucket 4 (one dummy), 5 exceed the largest bucket and run eagerly; flex
    # with test_backend_flex.py's buckets, so the two modules share their compiled kernels
    attn: Attention = SdpaAttention() if attention == "sdpa" else FlexAttention(min_batch=4)
    graphs = with_graphs(backend, attn, buckets=(1, 2, 4), capture=False)
    eager = eager_of(backend, attn)
    for n in (1, 3, 5) if attention == "sdpa" else (1, 3):  # (flex: fewer shapes to compile)
        seqs = prompts(backend, n)
        assert graphs.generate_batch(seqs, 4, stop_tokens=[]) == eager.generate_batch(seqs, 4, stop_tokens=[])
    assert graphs.graphs is not None and {b for b, _ in graphs.graphs.captured()} == {1, 4}
    # logits too: a decode step over 3 ragged contexts
    ps = backend.info.page_size
    seqs = prompts(backend, 3)
    outs = []
    for be in (eager, graphs):
        pg = Pages(be, 100)
        pages = [pg.for_tokens(32) for _ in seqs]
        be.logits([req(p, 0, s, ps, outputs=[]) for p, s in zip(pages, seqs, strict=True)])
        outs.append(be.logits([req(p, len(s), [s[0]], ps) for p, s in zip(pages, seqs, strict=True)]))
    for i, (x, y) in enumerate(zip(*outs, strict=True)):
        assert_close(y, x, f"request {i}")


# (flex compiles its kernels on CPU, ~3.5 s: in `make test`, not in test-fast)
@pytest.mark.parametrize("attention", ["sdpa", pytest.param("flex", marks=pytest.mark.slow)])
def test_static_buffer_path_honours_the_window(attention):
    # a model whose first layer slides over 5 slots (the second is global): decode steps through
    # the graphs' static buffers, contexts past the window, equal the eager path; and the window
    # matters here (the same model without it decodes other logits)
    attn: Attention = SdpaAttention() if attention == "sdpa" else FlexAttention(min_batch=4)
    windowed = tiny_backend(seed=3, sliding_window=5, sliding_layers=(True, False))
    graphs = with_graphs(windowed, attn, buckets=(1, 2, 4), capture=False, num_pages=63)
    eager = eager_of(windowed, attn, num_pages=64)
    plain = eager_of(tiny_backend(seed=3), attn, num_pages=64)
    seqs = [list(b"the window slides"), list(b"a longer prompt, past the window")]
    outs = []
    for be in (eager, graphs, plain):
        pg = Pages(be, 10)
        pages = [pg.for_tokens(48) for _ in seqs]
        be.logits([req(p, 0, s, 4, outputs=[]) for p, s in zip(pages, seqs, strict=True)])
        outs.append(be.logits([req(p, len(s), [s[0]], 4) for p, s in zip(pages, seqs, strict=True)]))
    for i in range(len(seqs)):
        assert_close(outs[1][i], outs[0][i], f"request {i}")
        assert (outs[2][i] - outs[0][i]).abs().max() > 1e-2, "the window changed nothing"


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_cuda_graphs_equal_eager_token_for_token(attention):
    # fp32: a padded bucket runs other GEMM shapes than the eager batch, and bf16 rounding could
    # flip a near-tie between the two; fp32 keeps "token for token" a fair demand
    import os

    on = load_backend(os.environ.get("PIE_TEST_MODEL"), device="cuda", dtype=torch.float32, page_size=16,
                      num_pages=512, attention=attention, cuda_graphs=True, progress=False)
    off = TorchBackend(on.model, on.tokenizer, on.info, KVCache(on.model.cfg, 16, 512, on.model.device,
                                                                 on.model.dtype), on.attention)
    for n in (1, 3, 8, 20):  # buckets 1, 4, 8, 32: every padded case
        seqs = prompts(on, n)
        assert on.generate_batch(seqs, 16, stop_tokens=[]) == off.generate_batch(seqs, 16, stop_tokens=[])
    assert on.graphs is not None and {b for b, _ in on.graphs.captured()} == {1, 4, 8, 32}
