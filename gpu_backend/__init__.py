"""The PyTorch backend: model loading, tokenizer, paged KV cache, batched forward and sampling."""

from .backend import Backend, load_backend
from .config import ModelConfig, ModelInfo
from .tokenizer import Tokenizer
from .types import ForwardError, ForwardRequest, OutputResult, OutputSpec, SamplerParams

__all__ = [
    "Backend",
    "ForwardError",
    "ForwardRequest",
    "ModelConfig",
    "ModelInfo",
    "OutputResult",
    "OutputSpec",
    "SamplerParams",
    "Tokenizer",
    "load_backend",
]
