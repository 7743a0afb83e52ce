"""Llama-family decoder (Llama, SmolLM, Qwen2) over the paged KV cache.

Weights are fused at build time (q|k|v into one matrix, gate|up into another) so a layer is four
matmuls; RoPE tables are precomputed. The layer loop touches no per-request Python: everything
request-specific lives in the BatchPlan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu_backend.attention import BatchPlan
from gpu_backend.kv_cache import KVCache
from gpu_backend.models.config import ModelConfig
from gpu_backend.models.rope import cos_sin_table


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class LlamaModel:
    """Weights plus the batched forward pass."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        self.device, self.dtype = device, dtype
        # tensor parallel (gpu_backend/engine/tp.py): sums the partial outputs of the row-parallel matmuls
        # (o_proj, down) across ranks, in place; None on a single rank
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name} missing from the checkpoint")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.norm = w("model.norm.weight")
        self.lm_head = self.embed if cfg.tie_embeddings else w("lm_head.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([w(att + f"{x}_proj.bias") for x in "qkv"])
            self.layers.append(
                LayerWeights(
                    attn_norm=w(p + "input_layernorm.weight"),
                    qkv=torch.cat([w(att + f"{x}_proj.weight") for x in "qkv"]),
                    qkv_bias=bias,
                    o_proj=w(att + "o_proj.weight"),
                    mlp_norm=w(p + "post_attention_layernorm.weight"),
                    gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                    down=w(p + "mlp.down_proj.weight"),
                )
            )
        half = cfg.head_dim // 2
        cos, sin = cos_sin_table(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position, device, dtype,
                                 weights.get("rope_freqs"))
        self.cos = cos
        # rotate_half(x) * sin == flip-halves(x) * [-sin_lo, sin_hi]
        self.sin_signed = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)

    def weight_bytes(self) -> int:
        """Bytes of weights a decode step reads (each matrix once; tied embeddings count once)."""
        tensors = [self.embed, self.norm] + ([] if self.lm_head is self.embed else [self.lm_head])
        for lw in self.layers:
            tensors += [lw.attn_norm, lw.qkv, lw.o_proj, lw.mlp_norm, lw.gate_up, lw.down]
            tensors += [] if lw.qkv_bias is None else [lw.qkv_bias]
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, plan: BatchPlan, cache: KVCache) -> torch.Tensor:
        """Run all layers, write the new K/V, return float32 logits of `plan.output_rows` [M, vocab]."""
        cfg = self.cfg
        h, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        hid, inter, eps = cfg.hidden_size, cfg.intermediate_size, cfg.rms_eps
        x = self.embed[plan.tokens]
        n = x.shape[0]
        cos = self.cos[plan.positions].unsqueeze(1)
        sin = self.sin_signed[plan.positions].unsqueeze(1)
        reduce = self.reduce
        for li, lw in enumerate(self.layers):
            y = F.rms_norm(x, (hid,), lw.attn_norm, eps)
            qkv = F.linear(y, lw.qkv, lw.qkv_bias).view(n, h + 2 * kvh, d)
            qk = qkv[:, : h + kvh]
            qk = qk * cos + qk.view(n, h + kvh, 2, d // 2).flip(2).view(n, h + kvh, d) * sin
            kv_new = torch.cat([qk[:, h:], qkv[:, h + kvh :]], dim=1).view(n, 2, kvh, d)
            layer_cache = cache.data[li]
            layer_cache.index_copy_(0, plan.write_slots, kv_new)
            attn = plan.attend(qk[:, :h], layer_cache)
            o = F.linear(attn, lw.o_proj)
            x = x + (o if reduce is None else reduce(o))
            y = F.rms_norm(x, (hid,), lw.mlp_norm, eps)
            gu = F.linear(y, lw.gate_up)
            o = F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], lw.down)
            x = x + (o if reduce is None else reduce(o))
        x = F.rms_norm(x[plan.output_rows], (hid,), self.norm, eps)
        return F.linear(x, self.lm_head).float()
