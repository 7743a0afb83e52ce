"""The backend's swap capability (`gpu_backend.types.SwapsPages`): pages' K/V copied to host memory
and back into other pages continue the sequence exactly as the original pages do."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from gpu_backend.kv_cache import KVCache
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams, SwapsPages

GREEDY = SamplerParams()


def _continue(be: Any, pages: list[int], last_len: int, token: int, position: int) -> torch.Tensor:
    """The float32 logits of one more step over `pages` (logits, not probabilities: a random model's
    distribution can be one-hot whatever it attends to, as the kit's was on an H200)."""
    return be.logits([ForwardRequest(pages=pages, last_page_len=last_len, tokens=[token], positions=[position],
                                     outputs=[OutputSpec(index=0)])])[0][0].float().cpu()


def check_swap_round_trip(be: Any) -> None:
    assert isinstance(be, SwapsPages)
    ps = be.info.page_size
    assert be.swap_page_bytes == KVCache.bytes_per_page(be.model.cfg, ps, be.cache.data.dtype)
    tokens = be.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 8)[: 3 * ps + 5]
    src, dst = [0, 1, 2, 3], [10, 7, 12, 9]
    first = be.forward([ForwardRequest(pages=src, last_page_len=5, tokens=tokens, positions=list(range(len(tokens))),
                                       outputs=[OutputSpec(index=len(tokens) - 1, sample=GREEDY)])])[0][0].token
    assert first is not None
    be.swap_in(be.swap_out(src), dst)
    want = _continue(be, src, 6, first, len(tokens))
    got = _continue(be, dst, 6, first, len(tokens))
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= 1e-3 * scale  # the same K/V, the same kernels
    other = _continue(be, [20, 21, 22, 23], 6, first, len(tokens))  # pages never written: differs
    assert float((other - want).abs().max()) > 1e-2 * scale


def test_swap_round_trip_on_cpu(backend) -> None:  # noqa: ANN001
    check_swap_round_trip(backend)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_swap_round_trip_on_cuda() -> None:
    from gpu_backend import load_backend

    check_swap_round_trip(load_backend(os.environ.get("PIE_TEST_MODEL"), device="cuda", num_pages=64, progress=False))
