"""Loading: model metadata, KV sizing from a memory budget, the weight cache keeps reloads fast."""

from __future__ import annotations

import os
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


def test_gpu_memory_utilization_sizes_the_cache_on_cuda_and_keeps_256_mib_on_cpu(backend):  # noqa: ARG001
    be = load_backend(device="cpu", dtype=torch.bfloat16, page_size=32, gpu_memory_utilization=0.9, progress=False)
    assert be.info.num_pages == 256 * 2**20 // KVCache.bytes_per_page(be.model.cfg, 32, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_utilization_leaves_the_rest_of_the_gpu_free():
    from gpu_backend.build import ACTIVATION_RESERVE_BYTES

    free0, total = torch.cuda.mem_get_info()
    be = load_backend(os.environ.get("PIE_TEST_MODEL"), device="cuda", gpu_memory_utilization=0.5, progress=False)
    free1, _ = torch.cuda.mem_get_info()
    used = free0 - free1  # weights + cache (+ CUDA graphs' pools)
    assert be.info.num_pages > 1000
    assert used <= 0.5 * total - (total - free0) + ACTIVATION_RESERVE_BYTES
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache"):
        load_backend(os.environ.get("PIE_TEST_MODEL"), device="cuda", gpu_memory_utilization=0.01, progress=False)
