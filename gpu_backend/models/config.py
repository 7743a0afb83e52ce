"""Configuration dataclasses: the model architecture (with its per-layer spec) and the metadata the host sees.

A family's differences from Llama are data here, not branches in the forward: which norms a layer
has and how they scale, the MLP's activation, the embedding scale, attention's scale and
soft-capping, and each layer's sliding window and RoPE table (`ModelConfig.layer_specs`).
`hf_dir.py` and `gguf.py` fill them in from the checkpoint's config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class LayerSpec:
    """What differs between the layers of one model.

    window: keys a query sees, itself included (logical cache slots `(s - window, s]` for the query in
    slot s, as transformers' sliding-window mask), 0 = all earlier slots. rope: index of the layer's
    RoPE table in `ModelConfig.rope_tables()`.
    """

    window: int = 0
    rope: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3).

    The defaults are Llama's; the fields after `rope_scaling` describe the other families.
    """

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm: bool = False
    # RMSNorm multiplies by (norm_offset + weight): Gemma stores weight - 1 (offset 1.0)
    norm_offset: float = 0.0
    # norms on the attention and MLP outputs too, before the residual add (Gemma 2 / 3)
    sandwich_norms: bool = False
    # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    embed_scale: float = 1.0
    # the MLP gate's activation: silu (Llama) or gelu_tanh (Gemma)
    activation: str = "silu"
    # softmax scale of attention; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    # cap * tanh(x / cap) on attention scores / final logits (Gemma 2); None = off
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # sliding-window attention: window size (0 = none) and which layers slide (empty = every layer)
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    # RoPE base of the sliding layers, unscaled (Gemma 3's rope_local_base_freq); None = rope_theta
    local_rope_theta: float | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}: supported are {ACTIVATIONS}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")

    def layer_specs(self) -> list[LayerSpec]:
        """Each layer's window and RoPE table."""
        slides = self.sliding_layers or (True,) * self.num_layers
        local_table = 1 if self.local_rope_theta is not None else 0
        return [LayerSpec(window=self.sliding_window, rope=local_table) if s and self.sliding_window
                else LayerSpec() for s in slides]

    def rope_tables(self) -> list[tuple[float, dict[str, Any] | None]]:
        """(theta, scaling) of each RoPE table: the model's, then the sliding layers' own if they have one."""
        tables: list[tuple[float, dict[str, Any] | None]] = [(self.rope_theta, self.rope_scaling)]
        if self.local_rope_theta is not None:
            tables.append((self.local_rope_theta, None))
        return tables

    @property
    def long_rope_from(self) -> int:
        """Longrope with long factors (Phi-3 128k): transformers rotates a pass's tokens with the long
        factors once the sequence is longer than `original_max_position_embeddings` (its last
        position in the pass reaches this), else with the short ones; 0 = one set of factors."""
        s = self.rope_scaling
        if s is None or s.get("rope_type", s.get("type")) not in ("longrope", "su") or not s.get("long_factor"):
            return 0
        orig = int(s["original_max_position_embeddings"])
        return orig if self.max_position > orig else 0

    @property
    def window(self) -> int:
        """The sliding window of the layers that have one (one size per model), 0 = no layer slides."""
        return max(s.window for s in self.layer_specs())

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if "sliding_layers" in d:  # a list after a JSON round trip
            d["sliding_layers"] = tuple(d["sliding_layers"])
        return cls(**d)


@dataclass(frozen=True)
class ModelInfo:
    """What the host needs to know about the loaded model and its KV cache."""

    name: str
    page_size: int
    num_pages: int
    vocab_size: int
    stop_tokens: list[int]
    chat_template: str
    bos_token_id: int | None
    eos_token_id: int | None
    device: str
    dtype: str
    max_position: int = 0
