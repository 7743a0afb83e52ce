"""Cases of tests/test_triton_attention.py that launch the Triton kernel: run by it in a subprocess
with TRITON_INTERPRET=1 (Triton's interpreter on CPU tensors). The variable must be set before
triton is first imported (triton.language's own helpers, `tl.cdiv` and the reductions, are wrapped
by `triton.jit` at its import), which a pytest worker that imported torch's inductor or flex
attention first cannot guarantee; a fresh process can. Not collected on its own (no test_ prefix).

Random caches with shuffled, non-contiguous pages and ragged lengths (1, under a page, not a
multiple of the page size, several KV blocks), GQA groups 1 / 2 / 4, a sliding window, soft-capping
and a softmax scale, with and without split-KV; float32, so the kernel and SDPA agree to ~1e-7.
float32 only: Triton 3.6's interpreter gets `tl.dot` of bf16 operands wrong (~1e10 off on a plain
16 x 16 product; loads and stores of bf16 are right), so bf16 is checked on the GPU only (the `gpu`
test in tests/test_triton_attention.py, bench/triton_attention.py's parity section).
The end-to-end cases run a tiny random Llama's greedy decode with "triton" and "sdpa", eagerly and
through the CUDA-graph static buffers (`DecodeGraphs(capture=False)`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import torch
import triton
from backend_checks import Pages, decode_batch, req, tiny_backend

from gpu_backend import ForwardRequest, TorchBackend
from gpu_backend.attention import AttnSpec, SdpaAttention, build_plan
from gpu_backend.attention.triton_paged import TritonAttention, TritonMeta
from gpu_backend.cuda_graphs import DecodeGraphs
from gpu_backend.kv_cache import KVCache

if not triton.knobs.runtime.interpret or os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run with TRITON_INTERPRET=1 set before triton is imported (tests/test_triton_attention.py)")

CPU = torch.device("cpu")
WINDOW = 7
SPECS = {
    "global": AttnSpec(),
    "window": AttnSpec(local=True),
    "scale+softcap": AttnSpec(scale=0.37, softcap=1.5),
    "window+softcap": AttnSpec(local=True, softcap=3.0),
}


def both(reqs: list[ForwardRequest], ps: int, group: int, num_pages: int, kvh: int, d: int, spec: AttnSpec,
         triton_attn: TritonAttention, seed: int = 0, static: bool = False,
         kv_slots: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_pages * ps, 2, kvh, d, generator=g)
    # queries as the model passes them: a view into a wider [N, H + KVH, D] tensor (not contiguous)
    q = torch.randn(len(reqs), kvh * group + kvh, d, generator=g)[:, : kvh * group]
    outs = []
    for attn in (SdpaAttention(), triton_attn):
        plan = build_plan(reqs, ps, CPU, group, attn, num_pages=num_pages, window=WINDOW, static=static,
                          kv_slots=kv_slots)
        outs.append(attn.attend(q, kv, plan, spec))
    return outs[0], outs[1]


def check_kernel(group: int, spec: str, splits: int) -> None:
    # lengths: 1, < a page, not a multiple of the page size, exactly pages, past several KV blocks
    ps, num_pages, kvh, d = 3, 64, 2, 16
    rng = np.random.default_rng(group * 10 + splits)
    reqs = decode_batch(rng, [1, 2, 9, 12, 40, 70], ps, num_pages)
    ref, out = both(reqs, ps, group, num_pages, kvh, d, SPECS[spec], TritonAttention(block_n=16, splits=splits),
                    seed=group)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("group", "spec"), [(1, "window+softcap"), (2, "scale+softcap"), (4, "window")])
def test_kernel_quick(group, spec):
    check_kernel(group, spec, 3)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("spec", list(SPECS), ids=list(SPECS))
@pytest.mark.parametrize("splits", [1, 3])
def test_kernel_matrix(group, spec, splits):
    check_kernel(group, spec, splits)


@pytest.mark.parametrize("ps", [1, 16])
def test_page_sizes_head_dims_and_auto_splits(ps):
    # a head_dim that is not a power of two (the kernel pads it), auto splits, a batch of one
    num_pages = 256 // ps
    rng = np.random.default_rng(ps)
    attn = TritonAttention(block_n=16)
    for lens in ([1], [100], [33, 5, 64]):
        reqs = decode_batch(rng, lens, ps, num_pages)
        for spec in (SPECS["global"], SPECS["window"]):
            ref, out = both(reqs, ps, 2, num_pages, 1, 24, spec, attn)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert attn.num_splits(1, 1, 128, CPU) > 1, "a lone request over a long KV axis is split"
    assert attn.num_splits(64, 2, 128, CPU) == 1


def test_static_metadata_shapes_depend_only_on_batch_and_graph_slots():
    # what a captured CUDA graph needs: two decode batches of the same size padded to the same
    # graph_slots build tensors of the same shapes (table width = kv_slots / page_size), and the
    # graph path's output equals SDPA's
    ps, num_pages = 4, 64
    attn = TritonAttention(block_n=16)
    rng = np.random.default_rng(5)
    shapes = []
    for lens in ([1, 30], [17, 64]):
        reqs = decode_batch(rng, lens, ps, num_pages)
        slots = attn.graph_slots(max(lens))
        assert slots == 64
        meta = build_plan(reqs, ps, CPU, 2, attn, num_pages=num_pages, kv_slots=slots, static=True).meta
        assert isinstance(meta, TritonMeta)
        assert meta.table.dtype == torch.int32 and meta.lens.dtype == torch.int32
        shapes.append((meta.table.shape, meta.lens.shape))
        ref, out = both(reqs, ps, 2, num_pages, 2, 16, SPECS["window"], attn, static=True, kv_slots=slots)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert shapes[0] == shapes[1] == ((2, 16), (2,))
    assert attn.graph_slots(65) == 128


# ---- end to end: a tiny random Llama, greedy decode, "triton" == "sdpa" token for token ----

PAGES = 63


def on(backend: TorchBackend, attention: SdpaAttention | TritonAttention, graphs: bool) -> TorchBackend:
    """The same model with a fresh cache (plus the graphs' scratch page) and `attention`."""
    m = backend.model
    ps = backend.info.page_size
    cache = KVCache(m.cfg, ps, PAGES + 1, m.device, m.dtype)
    dg = DecodeGraphs(m, cache, attention, ps, scratch_page=PAGES, buckets=(1, 2, 4), capture=False) if graphs else None
    return TorchBackend(m, backend.tokenizer, replace(backend.info, num_pages=PAGES), cache, attention, dg)


@pytest.mark.parametrize("model", ["plain", "window+softcap"])
def test_greedy_decode_equals_sdpa_eager_and_through_graph_buffers(model):
    change = {} if model == "plain" else dict(sliding_window=5, sliding_layers=(True, False), attn_softcap=4.0,
                                              attn_scale=0.2)
    tiny = tiny_backend(seed=7, **change)  # type: ignore[arg-type]
    seqs = [list(b"the kernel reads pages"), list(b"in place"), list(b"x")]
    want = on(tiny, SdpaAttention(), graphs=False).generate_batch(seqs, 6, stop_tokens=[])
    for graphs in (False, True):
        be = on(tiny, TritonAttention(block_n=16), graphs)
        assert be.generate_batch(seqs, 6, stop_tokens=[]) == want, f"graphs={graphs}"
        if graphs:
            assert be.graphs is not None and be.graphs.captured() == [(4, 64)]
    # logits of one decode step over ragged contexts, eager and through the buffers
    ps = tiny.info.page_size
    outs = []
    for be in (on(tiny, SdpaAttention(), False), on(tiny, TritonAttention(block_n=16), False),
               on(tiny, TritonAttention(block_n=16), True)):
        pg = Pages(be, 3)
        pages = [pg.for_tokens(40) for _ in seqs]
        be.logits([req(p, 0, s, ps, outputs=[]) for p, s in zip(pages, seqs, strict=True)])
        outs.append(torch.stack(be.logits([req(p, len(s), [s[0]], ps) for p, s in zip(pages, seqs, strict=True)])))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], rtol=1e-5, atol=1e-5)


