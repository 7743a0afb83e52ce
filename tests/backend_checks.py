"""Batched-forward checks shared by the CPU tests and the CUDA tests (tests/test_backend_*.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from gpu_backend import ForwardRequest, OutputSpec, TorchBackend
from gpu_backend.attention import Attention
from gpu_backend.kv_cache import KVCache

TOL = 1e-3  # same weights, same dtype: only summation order differs between batch shapes


class Pages:
    """A trivial page allocator over a backend's cache, for tests."""

    def __init__(self, backend: TorchBackend, start: int = 0) -> None:
        self.next = start
        self.backend = backend

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        assert self.next <= self.backend.info.num_pages
        return out

    def for_tokens(self, n: int) -> list[int]:
        """Enough pages for `n` tokens at the backend's page size."""
        return self.take(math.ceil(n / self.backend.info.page_size))


def req(pages: list[int], ctx: int, tokens: list[int], ps: int, positions: list[int] | None = None,
        mask: list[list[int]] | None = None, outputs: list[int] | None = None) -> ForwardRequest:
    """A request appending `tokens` after `ctx` tokens already in `pages` (only the pages needed)."""
    total = ctx + len(tokens)
    used = math.ceil(total / ps)
    return ForwardRequest(
        pages=pages[:used], last_page_len=total - (used - 1) * ps, tokens=tokens,
        positions=positions if positions is not None else list(range(ctx, total)), mask=mask,
        outputs=[OutputSpec(index=i) for i in (outputs if outputs is not None else range(len(tokens)))],
    )


def decode_batch(rng: np.random.Generator, lens: list[int], ps: int, num_pages: int) -> list[ForwardRequest]:
    """One new token per request, each on its own shuffled (non-contiguous) pages."""
    free = [int(p) for p in rng.permutation(num_pages)]
    reqs = []
    for n in lens:
        pages = [free.pop() for _ in range(-(-n // ps))]
        reqs.append(ForwardRequest(pages=pages, last_page_len=n - (len(pages) - 1) * ps, tokens=[1],
                                   positions=[n - 1]))
    return reqs


def assert_close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    diff = (a - b).abs().max().item()
    assert diff < TOL, f"{what}: max |diff| {diff}"
    assert torch.equal(a.argmax(-1), b.argmax(-1)), f"{what}: top-1 differs"


def with_page_size(backend: TorchBackend, page_size: int, num_pages: int,
                   attention: Attention | None = None) -> TorchBackend:
    """Same model, a fresh cache with another page size (and another attention path if given)."""
    info = replace(backend.info, page_size=page_size, num_pages=num_pages)
    cache = KVCache(backend.model.cfg, page_size, num_pages, backend.model.device, backend.model.dtype)
    return TorchBackend(backend.model, backend.tokenizer, info, cache, attention)


def check_ragged_batch_equals_each_alone(backend, texts):
    ps = backend.info.page_size
    a, b, c = texts["a"], texts["b"], texts["c"]
    c_ctx, c_new = c[:-3], c[-3:]
    pg = Pages(backend)
    # alone
    pa, pb, pc = pg.for_tokens(64), pg.for_tokens(64), pg.for_tokens(64)
    alone_a = backend.logits([req(pa, 0, a, ps)])[0]
    alone_b = backend.logits([req(pb, 0, b, ps)])[0]
    backend.logits([req(pc, 0, c_ctx, ps, outputs=[])])
    alone_c = backend.logits([req(pc, len(c_ctx), c_new, ps)])[0]
    # together: two prefills of different lengths and a continuation over existing context
    pa2, pb2, pc2 = pg.for_tokens(64), pg.for_tokens(64), pg.for_tokens(64)
    backend.logits([req(pc2, 0, c_ctx, ps, outputs=[])])
    got = backend.logits([req(pa2, 0, a, ps), req(pb2, 0, b, ps), req(pc2, len(c_ctx), c_new, ps)])
    for name, x, y in zip("abc", got, [alone_a, alone_b, alone_c], strict=True):
        assert_close(x, y, f"request {name}")


def check_tree_mask_equals_separate_branches(backend, texts, first_page=200):
    ps = backend.info.page_size
    prefix, b1, b2 = texts["a"][:5], texts["b"][:4], texts["c"][:3]
    pg = Pages(backend, first_page)
    # separately
    p1, p2 = pg.for_tokens(32), pg.for_tokens(32)
    sep1 = backend.logits([req(p1, 0, prefix + b1, ps)])[0][len(prefix):]
    sep2 = backend.logits([req(p2, 0, prefix + b2, ps)])[0][len(prefix):]
    # one pass: prefix in context, both branches in the same pass with a tree mask
    pt = pg.for_tokens(32)
    backend.logits([req(pt, 0, prefix, ps, outputs=[])])
    n = len(prefix)
    mask = [[n + i + 1] for i in range(len(b1))] + [[n, len(b1), j + 1] for j in range(len(b2))]
    positions = list(range(n, n + len(b1))) + list(range(n, n + len(b2)))
    tree = backend.logits([req(pt, n, b1 + b2, ps, positions=positions, mask=mask)])[0]
    assert_close(tree[: len(b1)], sep1, "branch 1")
    assert_close(tree[len(b1):], sep2, "branch 2")


def tiny_backend(seed: int = 0, vocab: int = 256, page_size: int = 4, num_pages: int = 256,
                 **change: object) -> TorchBackend:
    """A 2-layer Llama with random weights and a byte-level tokenizer (token i = byte i): no model
    file needed, for fast tests of the backend's machinery (not of its numbers)."""
    from gpu_backend.build import backend_from_weights
    from gpu_backend.loading.model_files import GPT2_PATTERN, TokenizerSpec
    from gpu_backend.loading.tokenizer import _unicode_to_byte
    from gpu_backend.models.config import ModelConfig

    cfg = ModelConfig(arch="llama", num_layers=2, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16, vocab_size=vocab, rms_eps=1e-6, rope_theta=10000.0,
                      max_position=4096, tie_embeddings=True)
    cfg = replace(cfg, **change)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5

    h, d, kv, inter = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads, cfg.intermediate_size
    w = {"model.embed_tokens.weight": rnd(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": rnd(cfg.num_heads * d, h), p + "self_attn.k_proj.weight": rnd(kv * d, h),
              p + "self_attn.v_proj.weight": rnd(kv * d, h), p + "self_attn.o_proj.weight": rnd(h, cfg.num_heads * d),
              p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
              p + "mlp.down_proj.weight": rnd(h, inter)}
    chars = {b: c for c, b in _unicode_to_byte().items()}
    spec = TokenizerSpec(tokens=[chars[i % 256] * (1 + i // 256) for i in range(vocab)], special={},
                         pattern=GPT2_PATTERN, chat_template="", bos_token_id=None, eos_token_id=None,
                         pad_token_id=None, stop_tokens=[])
    return backend_from_weights(cfg, w, spec, "tiny", device=torch.device("cpu"), dtype=torch.float32,
                                page_size=page_size, num_pages=num_pages)
