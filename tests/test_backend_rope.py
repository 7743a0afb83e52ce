"""RoPE tables: llama3 scaling as transformers computes it, and GGUF's rope_freqs form of it."""

from __future__ import annotations

import pytest
import torch

from gpu_backend.models.rope import cos_sin_table, inv_frequencies

LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_llama3_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=2048, num_attention_heads=32, head_dim=64,
                                   rope_scaling=dict(LLAMA3), rope_theta=500000.0, max_position_embeddings=131072)
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    ours = inv_frequencies(64, 500000.0, LLAMA3).float()
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)


def test_gguf_freq_factors_equal_llama3_scaling():
    base = inv_frequencies(64, 500000.0, None).float()
    scaled = inv_frequencies(64, 500000.0, LLAMA3).float()
    factors = base / scaled  # what llama.cpp writes to rope_freqs.weight
    a = cos_sin_table(64, 500000.0, LLAMA3, 4096, torch.device("cpu"), torch.float32)
    b = cos_sin_table(64, 500000.0, None, 4096, torch.device("cpu"), torch.float32, freq_factors=factors)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(a[0], cos_sin_table(64, 500000.0, None, 4096, torch.device("cpu"), torch.float32)[0])


def test_unknown_scaling_rejected():
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        inv_frequencies(64, 10000.0, {"rope_type": "yarn", "factor": 4.0})
