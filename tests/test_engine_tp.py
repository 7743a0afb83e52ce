"""Tensor parallel (gpu_backend/engine/tp.py): the shard arithmetic, two gloo ranks on a tiny random model
(fast), and `--tp 2` against `--tp 1` on the default model through engine processes (slow).

Tolerance: logits of two ranks are the same sums in another order, so they agree with one rank's
to float32 rounding; stated bound 1e-3 absolute (measured ~4e-5 on SmolLM2-135M), and greedy
tokens equal token for token."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

from gpu_backend.engine.tp import check_shardable, shard_config, shard_weights, split
from gpu_backend.models.config import ModelConfig
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams

TOL = 1e-3
PAGES = [2, 5, 7, 11]  # pages of the sequence in the slow test (not in order, on purpose)
# SmolLM2-135M's shape in miniature: 9 query heads over 3 KV heads (group 3), which 2 ranks split
# unevenly; an odd MLP width; q/k/v biases (Qwen2) so the bias slices are exercised too
TINY = ModelConfig(arch="llama", num_layers=2, hidden_size=72, intermediate_size=97, num_heads=9, num_kv_heads=3,
                   head_dim=8, vocab_size=64, rms_eps=1e-5, rope_theta=10000.0, max_position=128,
                   tie_embeddings=False, qkv_bias=True)


def tiny_weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    h, d, kv, hid, inter = cfg.num_heads, cfg.head_dim, cfg.num_kv_heads, cfg.hidden_size, cfg.intermediate_size

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    w = {"model.embed_tokens.weight": r(cfg.vocab_size, hid), "model.norm.weight": 1 + r(hid),
         "lm_head.weight": r(cfg.vocab_size, hid)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + r(hid), p + "post_attention_layernorm.weight": 1 + r(hid),
              p + "self_attn.q_proj.weight": r(h * d, hid), p + "self_attn.q_proj.bias": r(h * d),
              p + "self_attn.k_proj.weight": r(kv * d, hid), p + "self_attn.k_proj.bias": r(kv * d),
              p + "self_attn.v_proj.weight": r(kv * d, hid), p + "self_attn.v_proj.bias": r(kv * d),
              p + "self_attn.o_proj.weight": r(hid, h * d), p + "mlp.gate_proj.weight": r(inter, hid),
              p + "mlp.up_proj.weight": r(inter, hid), p + "mlp.down_proj.weight": r(hid, inter)}
    return w


def tiny_logits(rank: int, world: int, init: str) -> torch.Tensor:
    """Prefill 13 tokens then decode 3, on `world` ranks (this one is `rank`); logits of every pass."""
    from gpu_backend.attention import build_plan
    from gpu_backend.kv_cache import KVCache
    from gpu_backend.models.llama import LlamaModel

    cfg, w = TINY, tiny_weights(TINY)
    if world > 1:
        from gpu_backend.engine.tp import init_tp

        tp = init_tp(rank, world, init, "cpu")
        w, cfg = shard_weights(TINY, w, rank, world), shard_config(TINY, rank, world)
    model = LlamaModel(cfg, w, torch.device("cpu"), torch.float32)
    if world > 1:
        model.reduce = tp.all_reduce
    cache = KVCache(cfg, 4, 8, torch.device("cpu"), torch.float32)
    toks, out = [5, 9, 2, 33, 17, 8, 60, 1, 4, 4, 21, 30, 12], []
    with torch.inference_mode():
        new = toks
        for _ in range(4):
            n = len(toks)
            req = ForwardRequest(pages=[3, 0, 6, 1][: (n + 3) // 4], last_page_len=n - 4 * ((n + 3) // 4 - 1),
                                 tokens=new, positions=list(range(n - len(new), n)),
                                 outputs=[OutputSpec(index=len(new) - 1, sample=SamplerParams())])
            logits = model.forward(build_plan([req], 4, torch.device("cpu"), model.group), cache)
            out.append(logits)
            nxt = int(logits[-1].argmax())
            toks, new = toks + [nxt], [nxt]
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return torch.cat(out)


def _rank_main(rank: int, world: int, init: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch.save(tiny_logits(rank, world, init), os.path.join(out_dir, f"rank{rank}.pt"))


def test_split_and_shard_shapes() -> None:
    assert split(3, 2) == [(0, 2), (2, 1)] and split(97, 2) == [(0, 49), (49, 48)] and split(4, 4)[3] == (3, 1)
    a, b = shard_config(TINY, 0, 2), shard_config(TINY, 1, 2)
    assert (a.num_heads, a.num_kv_heads, b.num_heads, b.num_kv_heads) == (6, 2, 3, 1)
    assert a.intermediate_size + b.intermediate_size == 97
    w = tiny_weights(TINY)
    s1 = shard_weights(TINY, w, 1, 2)
    assert s1["model.layers.0.self_attn.q_proj.weight"].shape == (3 * 8, 72)
    assert torch.equal(s1["model.layers.0.self_attn.k_proj.bias"], w["model.layers.0.self_attn.k_proj.bias"][16:])
    assert torch.equal(s1["model.layers.0.self_attn.o_proj.weight"], w["model.layers.0.self_attn.o_proj.weight"][:, 48:])
    assert s1["model.layers.1.mlp.down_proj.weight"].shape == (72, 48)
    assert s1["lm_head.weight"] is w["lm_head.weight"]  # replicated
    with pytest.raises(ValueError, match="3 KV heads"):
        check_shardable(TINY, 4)


@pytest.mark.slow  # (two gloo processes; make test runs it)
def test_two_gloo_ranks_match_one_rank_on_a_tiny_model() -> None:
    import torch.multiprocessing as mp

    ref = tiny_logits(0, 1, "")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank_main, args=(2, f"file://{d}/rendezvous", d), nprocs=2, join=True)
        got = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(2)]
    assert torch.equal(got[0], got[1])  # after each all-reduce every rank holds the same state
    assert (got[0] - ref).abs().max().item() < 1e-4
    assert torch.equal(got[0].argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_tp2_equals_tp1_on_the_default_model() -> None:
    from gpu_backend.engine.client import EngineSpec, ProcessBackend

    engines = {tp: ProcessBackend(EngineSpec(page_size=16, num_pages=16, tp=tp, dtype="float32", device="cpu"))
               for tp in (1, 2)}
    try:
        tok = engines[1].tokenizer
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Name three rivers in Europe."}]))
        results = {}
        for tp, eng in engines.items():
            n = len(prompt)
            assert 16 < n < 48
            ps = PAGES[: (n + 15) // 16]
            req = ForwardRequest(pages=ps, last_page_len=n - 16 * (len(ps) - 1), tokens=prompt,
                                 positions=list(range(n)), outputs=[OutputSpec(index=n - 1)])
            logits = eng.logits([req])[0]
            seq, new, toks = list(prompt), [int(logits[0].argmax())], []
            toks.append(new[0])
            for _ in range(15):  # greedy decode through the batch path
                seq += new
                n = len(seq)
                pages = PAGES[: (n + 15) // 16]
                (r,) = eng.forward([ForwardRequest(pages=pages, last_page_len=n - 16 * (len(pages) - 1), tokens=new,
                                                   positions=[n - 1], outputs=[OutputSpec(0, SamplerParams())])])
                new = [r[0].token]
                toks.append(new[0])
            results[tp] = (logits, toks)
        diff = abs(results[1][0] - results[2][0]).max()
        assert diff < TOL, diff
        assert results[1][1] == results[2][1]
    finally:
        for e in engines.values():
            e.close()
