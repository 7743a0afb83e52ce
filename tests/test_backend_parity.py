"""Logits parity with transformers on the same GGUF weights (prefill + 32 decode steps through pages)."""

from __future__ import annotations

import pytest
import torch
from parity import DECODE_STEPS, LOGIT_TOL, PROMPTS, run_parity

from gpu_backend.loading.loader import default_model_path


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, torch_dtype=torch.float32
    )
    return model.eval()


def test_logits_match_transformers(backend, hf_model):
    worst = run_parity(backend, hf_model, PROMPTS, DECODE_STEPS, LOGIT_TOL)
    print(f"max |logit diff| over {len(PROMPTS)} prompts x {DECODE_STEPS + 1} steps: {worst:.2e}")
