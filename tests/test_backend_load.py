"""Loading: model metadata, KV sizing from a memory budget, the weight cache keeps reloads fast."""

from __future__ import annotations

import time

import pytest
import torch

from gpu_backend import load_backend
from gpu_backend.kv_cache import KVCache


def test_default_model_info(backend):
    info = backend.info
    assert info.vocab_size == 49152 and info.page_size == 16 and info.num_pages == 2048
    assert info.bos_token_id == 1 and info.eos_token_id == 2 and info.stop_tokens == [2]
    assert "<|im_start|>" in info.chat_template
    assert info.device == "cpu" and info.dtype == "float32"
    assert backend.cache.data.shape == (30, 2048 * 16, 2, 3, 64)


def test_kv_pages_from_memory_budget_and_fast_reload(backend):
    # `backend` (session fixture) already loaded the model once, so the dequantized weights are cached
    per_page = KVCache.bytes_per_page(backend.model.cfg, 32, torch.bfloat16)
    assert per_page == 30 * 32 * 2 * 3 * 64 * 2
    t = time.perf_counter()
    be = load_backend(device="cpu", dtype=torch.bfloat16, page_size=32, kv_memory_bytes=10 * per_page + 5,
                      progress=False)
    assert time.perf_counter() - t < 10.0
    assert be.info.num_pages == 10 and be.info.dtype == "bfloat16"
    ids = be.tokenizer.encode("Hello")
    out = be.generate(ids, 3, stop_tokens=[], pages=[0])
    assert len(out) == 3


def test_bad_load_arguments():
    with pytest.raises(FileNotFoundError, match="model not found"):
        load_backend("/nonexistent/model.gguf", progress=False)
    with pytest.raises(ValueError, match="holds no page"):
        load_backend(device="cpu", kv_memory_bytes=10, progress=False)
