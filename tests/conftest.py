"""Shared pytest fixtures. Keep this small: fixtures used by more than one test module only."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def backend():
    """The default model (SmolLM2-135M GGUF) on CPU, float32, loaded once per test session."""
    import torch

    from gpu_backend import load_backend

    return load_backend(device="cpu", dtype=torch.float32, page_size=16, num_pages=512, progress=False)
