"""Compiled layers (`LlamaModel.hidden(compiled=True)`, `DecodeGraphs(compile_layers=True)`): the
regions between attentions through torch.compile (inductor) equal the eager layers, logits (fp32,
tight) and greedy tokens, on a tiny Llama and on variants with the optional parts (q/k norms, q|k|v
bias, Gemma's sandwich norms, embedding scale, soft-caps, gelu, sliding layers with their own RoPE).

On CPU the decode graphs run with `capture=False`: the forward on the static buffers, compiled the
same way (inductor's C++ backend here, Triton on CUDA). Inductor compiles for ~5-15 s per model on
CPU (a cold cache): the compiling tests are `heavy` (not in `make test-fast`) and use few buckets.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from backend_checks import Pages, req

from gpu_backend import TorchBackend
from gpu_backend.attention import SdpaAttention
from gpu_backend.build import backend_from_weights, load_backend
from gpu_backend.cuda_graphs import DecodeGraphs
from gpu_backend.kv_cache import KVCache
from gpu_backend.loading.model_files import GPT2_PATTERN, TokenizerSpec
from gpu_backend.loading.tokenizer import _unicode_to_byte
from gpu_backend.models import llama
from gpu_backend.models.config import ModelConfig

PAGES = 63  # + the scratch page graphs pad with
BUCKET = 4  # the one bucket the compiling tests use (3 requests: one padding row)

VARIANTS: dict[str, dict[str, Any]] = {
    "llama": {},
    # Qwen3 / Qwen2: per-head q/k norms, biases on q|k|v
    "qk_norm_bias": dict(qk_norm=True, qkv_bias=True),
    # Gemma 2/3: norms around attention and MLP, (1 + w) norms, scaled embeddings, soft-caps, gelu,
    # a sliding layer with its own RoPE table
    "gemma_like": dict(sandwich_norms=True, norm_offset=1.0, embed_scale=8.0, activation="gelu_tanh",
                       attn_softcap=50.0, final_softcap=30.0, attn_scale=0.2, qk_norm=True, sliding_window=6,
                       sliding_layers=(True, False), local_rope_theta=10000.0),
}


def tiny(variant: str, seed: int = 0, vocab: int = 256, num_pages: int = PAGES + 1, device: str = "cpu",
         cuda_graphs: bool = False, compile_layers: bool = False) -> TorchBackend:
    """A 2-layer model of the variant's family with random weights (every optional weight random
    too, so a part the compiled path dropped would show), byte-level tokenizer."""
    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=vocab, rms_eps=1e-6, rope_theta=500.0,
                      max_position=4096, tie_embeddings=True)
    cfg = replace(cfg, **VARIANTS[variant])
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.5) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    def norm(n: int) -> torch.Tensor:
        return 1 - cfg.norm_offset + rnd(n, scale=0.2)

    h, d, kv, inter, nh = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size, cfg.num_heads
    w = {"model.embed_tokens.weight": rnd(vocab, h, scale=0.5 / cfg.embed_scale), "model.norm.weight": norm(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        w |= {p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
              a + "q_proj.weight": rnd(nh * d, h), a + "k_proj.weight": rnd(kv * d, h),
              a + "v_proj.weight": rnd(kv * d, h), a + "o_proj.weight": rnd(h, nh * d),
              p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
              p + "mlp.down_proj.weight": rnd(h, inter)}
        if cfg.qkv_bias:
            w |= {a + "q_proj.bias": rnd(nh * d), a + "k_proj.bias": rnd(kv * d), a + "v_proj.bias": rnd(kv * d)}
        if cfg.qk_norm:
            w |= {a + "q_norm.weight": norm(d), a + "k_norm.weight": norm(d)}
        if cfg.sandwich_norms:
            w |= {p + "pre_feedforward_layernorm.weight": norm(h), p + "post_feedforward_layernorm.weight": norm(h)}
    chars = {b: c for c, b in _unicode_to_byte().items()}
    spec = TokenizerSpec(tokens=[chars[i % 256] * (1 + i // 256) for i in range(vocab)], special={},
                         pattern=GPT2_PATTERN, chat_template="", bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, stop_tokens=[])
    return backend_from_weights(cfg, w, spec, "tiny", device=torch.device(device), dtype=torch.float32,
                                page_size=4, num_pages=num_pages, cuda_graphs=cuda_graphs,
                                compile_layers=compile_layers)


def with_graphs(be: TorchBackend, compile_layers: bool) -> TorchBackend:
    """The same model over a fresh cache of PAGES pages + the scratch page, decode steps through the
    graphs' static buffers (bucket BUCKET), compiled or not."""
    m = be.model
    cache = KVCache(m.cfg, be.info.page_size, PAGES + 1, m.device, m.dtype)
    attn = SdpaAttention()
    graphs = DecodeGraphs(m, cache, attn, be.info.page_size, scratch_page=PAGES, buckets=(BUCKET,), capture=False,
                          compile_layers=compile_layers)
    return TorchBackend(m, be.tokenizer, replace(be.info, num_pages=PAGES), cache, attn, graphs)


SEQS = [[5, 9, 200, 31, 7, 7, 64, 12, 3], [100, 101, 102], [17, 250, 4, 4, 9, 33, 8]]


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process (so a test sees the compiled path really ran)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


@pytest.mark.heavy
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_compiled_decode_equals_eager(variant):
    be = tiny(variant, seed=list(VARIANTS).index(variant))
    plain, comp = with_graphs(be, False), with_graphs(be, True)
    before = compiled_graphs()
    # one decode step over 3 ragged contexts: logits of the compiled layers == eager, fp32
    ps = be.info.page_size
    outs = []
    for b in (plain, comp):
        pg = Pages(b, 10)
        pages = [pg.for_tokens(32) for _ in SEQS]
        b.logits([req(p, 0, s, ps, outputs=[]) for p, s in zip(pages, SEQS, strict=True)])  # prefill: eager
        outs.append(b.logits([req(p, len(s), [s[1]], ps) for p, s in zip(pages, SEQS, strict=True)]))
    # the first pre_attn, the regions between layers and the last one (fewer where an earlier test's
    # model compiled the same graph: the last region of a model without sandwich norms is Llama's)
    assert compiled_graphs() > before, "nothing was compiled"
    for i, (want, got) in enumerate(zip(*outs, strict=True)):
        err, scale = float((got - want).abs().max()), max(1.0, float(want.abs().max()))
        assert err < 1e-4 * scale, f"request {i}: logits differ by {err} (scale {scale})"
    # greedy decoding, token for token (contexts past the sliding window), all in what was compiled
    want = plain.generate_batch(SEQS, 10, stop_tokens=[])
    with torch.compiler.set_stance("fail_on_recompile"):
        assert comp.generate_batch(SEQS, 10, stop_tokens=[]) == want
    assert comp.graphs is not None and comp.graphs.captured() == [(BUCKET, 64)]


@pytest.mark.heavy
def test_one_compile_serves_every_bucket_but_1():
    """The batch dimension is dynamic (`LlamaModel.compile_static_batch` False): once a bucket of 2+
    rows has compiled, other buckets run without compiling again."""
    be = tiny("llama", seed=11)
    m = be.model
    cache = KVCache(m.cfg, 4, PAGES + 1, m.device, m.dtype)
    attn = SdpaAttention()
    graphs = DecodeGraphs(m, cache, attn, 4, scratch_page=PAGES, buckets=(2, 4, 8), capture=False,
                          compile_layers=True)
    comp = TorchBackend(m, be.tokenizer, replace(be.info, num_pages=PAGES), cache, attn, graphs)
    seqs = [[3 + i, 40 + i, 7] for i in range(6)]
    assert comp.generate_batch(seqs[:2], 3, stop_tokens=[]) == be.generate_batch(seqs[:2], 3, stop_tokens=[])
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (3, 6):  # buckets 4 and 8
            assert comp.generate_batch(seqs[:n], 3, stop_tokens=[]) == be.generate_batch(seqs[:n], 3, stop_tokens=[])
    assert [b for b, _ in graphs.captured()] == [2, 4, 8]


def test_eager_parts_are_the_layer():
    """hidden() with compile off is pre_attn / attention / post_attn, layer after layer (the parts the
    compiled regions are made of): the same as writing the layer out by hand."""
    import torch.nn.functional as F

    be = tiny("gemma_like", seed=5)
    m = be.model
    pg = Pages(be, 0)
    seq = SEQS[0]
    plan = be.plan([req(pg.for_tokens(16), 0, seq, be.info.page_size, outputs=list(range(len(seq))))])
    with torch.inference_mode():
        got = m.hidden(plan, be.cache)
        cfg = m.cfg
        dims = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps)
        x = m.embed[plan.tokens] * m.embed_scale
        for li, lw in enumerate(m.layers):
            cos, sin = m.cos[lw.rope][plan.positions].unsqueeze(1), m.sin_signed[lw.rope][plan.positions].unsqueeze(1)
            q = llama.pre_attn(x, lw.attn_norm, lw.qkv, lw.qkv_bias, lw.qk_norm, cos, sin, be.cache.data[li],
                               plan.write_slots, dims)
            o = plan.attend(q, be.cache.data[li], lw.attn)
            x = llama.post_attn(x, o, lw.o_proj, lw.attn_out_norm, lw.mlp_norm, lw.gate_up, lw.down, lw.mlp_out_norm,
                                dims, m.act)
        want = F.rms_norm(x[plan.output_rows], (cfg.hidden_size,), m.norm, cfg.rms_eps)
    assert torch.equal(got, want)


def test_compile_layers_needs_cuda_graphs_and_one_rank():
    with pytest.raises(ValueError, match="compile_layers=True compiles the CUDA-graph decode steps"):
        load_backend(device="cpu", compile_layers=True, progress=False)
    with pytest.raises(ValueError, match="it needs cuda_graphs=True"):
        tiny("llama", compile_layers=True)
    be = tiny("llama")
    m = be.model
    m.reduce = lambda t: t  # as tensor parallel sets it
    try:
        with pytest.raises(ValueError, match="single rank"):
            DecodeGraphs(m, be.cache, SdpaAttention(), 4, scratch_page=0, capture=False, compile_layers=True)
    finally:
        m.reduce = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_compiled_graphs_equal_uncompiled_on_cuda():
    """On CUDA (fp32): graphs captured over the compiled layers == graphs without them == eager,
    token for token (the compile happens in the warm-up: a compile during the capture would fail)."""
    outs = []
    for graphs, compile_layers in ((False, False), (True, False), (True, True)):
        be = tiny("qk_norm_bias", seed=7, device="cuda", cuda_graphs=graphs, compile_layers=compile_layers)
        outs.append(be.generate_batch(SEQS, 12, stop_tokens=[]))
        assert be.graphs is None or [b for b, _ in be.graphs.captured()] == [BUCKET]
    assert outs[0] == outs[1] == outs[2]
