"""The PyTorch backend: model loading, tokenizer, paged KV cache, batched forward and sampling.

Names are imported on first use, so `gpu_backend.types` (the batch format and the `Backend`
protocol) can be imported without loading torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Backend",
    "BackendInfo",
    "ForwardError",
    "ForwardRequest",
    "ModelConfig",
    "ModelInfo",
    "OutputResult",
    "OutputSpec",
    "SamplerParams",
    "TorchBackend",
    "Tokenizer",
    "load_backend",
]

_LAZY = {
    "TorchBackend": "backend", "load_backend": "build",
    "ModelConfig": "models.config", "ModelInfo": "models.config", "Tokenizer": "loading.tokenizer",
    "Backend": "types", "BackendInfo": "types", "ForwardError": "types", "ForwardRequest": "types",
    "OutputResult": "types", "OutputSpec": "types", "SamplerParams": "types",
}

if TYPE_CHECKING:
    from gpu_backend.backend import TorchBackend
    from gpu_backend.build import load_backend
    from gpu_backend.loading.tokenizer import Tokenizer
    from gpu_backend.models.config import ModelConfig, ModelInfo
    from gpu_backend.types import (
        Backend,
        BackendInfo,
        ForwardError,
        ForwardRequest,
        OutputResult,
        OutputSpec,
        SamplerParams,
    )


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gpu_backend' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"gpu_backend.{module}"), name)
