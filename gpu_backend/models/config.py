"""Configuration dataclasses: the model architecture and the metadata the host sees."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama, SmolLM, Qwen2)."""

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

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
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
