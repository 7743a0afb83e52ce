"""Rotary position embedding tables, honouring the config's rope_theta and rope scaling."""

from __future__ import annotations

import math
from typing import Any

import torch


def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None, long: bool = False) -> torch.Tensor:
    """Per-pair inverse frequencies, with `linear`, `llama3` or `longrope` scaling applied (as transformers
does). `longrope` (Phi-3's `su`) divides by its short factors, or by its long ones when `long`
(transformers uses those for a sequence longer than `original_max_position_embeddings`:
`ModelConfig.long_rope_from`)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - low) / (high - low)
        mid = (1 - smooth) * inv / factor + smooth * inv
        out = torch.where(wavelen > old_ctx / low, inv / factor, inv)
        is_mid = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        return torch.where(is_mid, mid, out)
    if kind in ("longrope", "su"):
        key = "long_factor" if long else "short_factor"
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != inv.numel():
            raise ValueError(f"longrope {key} has {ext.numel()} entries, head_dim / 2 is {inv.numel()}")
        return inv / ext
    raise ValueError(f"unsupported rope scaling type {kind!r}: supported are {ROPE_TYPES}")


ROPE_TYPES = ("default", "linear", "llama3", "longrope (su)")


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: 1, except under longrope (transformers' default formula)."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling.get("factor", 1.0))
    orig = float(scaling["original_max_position_embeddings"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))


def cos_sin_table(head_dim: int, theta: float, scaling: dict[str, Any] | None, max_position: int,
                  device: torch.device, dtype: torch.dtype, freq_factors: torch.Tensor | None = None,
                  long: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [max_position, head_dim], halves repeated (rotate_half convention).

    `freq_factors` (GGUF `rope_freqs.weight`, how llama.cpp stores Llama 3 scaling) divide the
    unscaled frequencies and replace `scaling`. `long`: longrope's long factors (`inv_frequencies`).
    """
    if freq_factors is not None:
        inv = inv_frequencies(head_dim, theta, None).float() / freq_factors.float().cpu()
    else:
        inv = inv_frequencies(head_dim, theta, scaling, long).float()
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    scale = attention_factor(None if freq_factors is not None else scaling)
    return (emb.cos() * scale).to(device, dtype), (emb.sin() * scale).to(device, dtype)
