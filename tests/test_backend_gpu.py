"""The CUDA path (SDPA; bf16 and fp32) against transformers on the GPU. Skipped without CUDA.

The model is $PIE_TEST_MODEL (a .gguf or HF dir) if set, else the default SmolLM2 GGUF.
"""

from __future__ import annotations

import os

import pytest
import torch
from backend_checks import check_ragged_batch_equals_each_alone, check_tree_mask_equals_separate_branches
from parity import PROMPTS, run_parity

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def model_arg() -> str | None:
    return os.environ.get("PIE_TEST_MODEL")


def load_hf(dtype: torch.dtype):
    transformers = pytest.importorskip("transformers")
    from pathlib import Path

    from gpu_backend.loading.loader import default_model_path

    arg = model_arg()
    path = default_model_path() if arg is None else Path(arg)
    if path.suffix == ".gguf":
        m = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    else:
        m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return m.to("cuda", dtype).eval()


def logit_scale(be) -> float:
    """The largest |logit| at the first prompt's last token (what bf16 rounding is relative to)."""
    from gpu_backend import ForwardRequest, OutputSpec

    ids = be.tokenizer.encode(PROMPTS[0])
    n = -(-len(ids) // 16)
    req = ForwardRequest(pages=list(range(n)), last_page_len=len(ids) - 16 * (n - 1), tokens=ids,
                         positions=list(range(len(ids))), outputs=[OutputSpec(index=len(ids) - 1)])
    return float(be.logits([req])[0].abs().max())


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def cuda_pair(request):
    from gpu_backend import load_backend

    be = load_backend(model_arg(), device="cuda", dtype=request.param, page_size=16, num_pages=512, progress=False)
    return be, load_hf(request.param)


@pytest.mark.slow
def test_cuda_logits_match_transformers(cuda_pair):
    be, hf = cuda_pair
    if be.model.dtype == torch.float32:
        # fp32 on both sides: as tight as on CPU (relative to the logits' scale, random test models
        # have flat logits)
        worst = run_parity(be, hf, PROMPTS, 32, 1e-2)
    else:
        # bf16 (8-bit mantissa): each op rounds to ~0.4% of its magnitude and the two implementations
        # round differently, so the bound scales with the logits (SmolLM2's reach ~20: 1.5 as before;
        # the GPU kit's random model reaches ~300, where an absolute 1.5 failed at 1.5 on the H100),
        # and near-ties may flip at a few steps.
        scale = logit_scale(be)
        worst = run_parity(be, hf, PROMPTS, 32, max(1.5, 0.02 * scale), min_top1=0.9)
    print(f"{be.model.dtype}: max |logit diff| {worst:.3g}")


@pytest.fixture(scope="module", params=["sdpa", "flex"])
def cuda_backend(request):
    from gpu_backend import load_backend

    return load_backend(model_arg(), device="cuda", dtype=torch.float32, page_size=16, num_pages=512,
                        progress=False, attention=request.param)


@pytest.fixture(scope="module")
def cuda_texts(cuda_backend):
    enc = cuda_backend.tokenizer.encode
    return {
        "a": enc("The quick brown fox jumps over the lazy dog."),
        "b": enc("In 1492, Columbus sailed the ocean blue; in 1969, humans walked on the Moon. Later,"),
        "c": enc("def add(a, b):\n    return a + b\n\nprint(add(2, 3))"),
    }


def test_cuda_ragged_batch(cuda_backend, cuda_texts):
    check_ragged_batch_equals_each_alone(cuda_backend, cuda_texts)


def test_cuda_tree_mask(cuda_backend, cuda_texts):
    check_tree_mask_equals_separate_branches(cuda_backend, cuda_texts)


def test_cuda_seeded_sampling_matches_itself(cuda_backend):
    from gpu_backend import ForwardRequest, OutputSpec, SamplerParams

    ids = cuda_backend.tokenizer.encode("Tell me a story")
    sp = SamplerParams(temperature=1.0, top_k=50, top_p=0.9, seed=3)

    def req(page: int) -> ForwardRequest:
        return ForwardRequest(pages=[page], last_page_len=len(ids), tokens=ids, positions=list(range(len(ids))),
                              outputs=[OutputSpec(index=len(ids) - 1, sample=sp, dist=5)])

    a = cuda_backend.forward([req(0)])[0][0]
    b = cuda_backend.forward([req(1), req(2)])[1][0]
    assert a.token == b.token and a.ids == b.ids


def test_cuda_start_forward_equals_forward(cuda_backend):
    """The overlapping path (queued with no host sync, tokens copied back behind an event) gives what
    `forward` gives, step for step, with the next steps prepared while each batch runs."""
    from dataclasses import replace as dc_replace

    from backend_checks import Pages, req

    from gpu_backend import OutputSpec, SamplerParams, TorchBackend
    from gpu_backend.kv_cache import KVCache

    be = cuda_backend
    m = be.model
    other = TorchBackend(m, be.tokenizer, be.info, KVCache(m.cfg, 16, 512, m.device, m.dtype), be.attention)
    ps = be.info.page_size
    seqs = [be.tokenizer.encode(t) for t in ("Hello there, how are", "1, 2, 3, 4,", "def f(x):")]
    sp = [SamplerParams(), SamplerParams(temperature=0.7, top_p=0.9, seed=5), SamplerParams()]
    runs = []
    for b, overlap in ((be, False), (other, True)):
        pg = Pages(b, 300)
        pages = [pg.for_tokens(64) for _ in seqs]
        toks = [list(s) for s in seqs]
        got = []
        for step in range(12):
            reqs = []
            for i, s in enumerate(toks):
                new = s if step == 0 else s[-1:]
                r = req(pages[i], len(s) - len(new), new, ps)
                reqs.append(dc_replace(r, outputs=[OutputSpec(index=len(new) - 1, sample=sp[i], dist=3)]))
            res = b.start_forward(reqs).wait() if overlap else b.forward(reqs)
            for i, r in enumerate(res):
                toks[i].append(r[0].token)
            got.append([(r[0].token, r[0].ids) for r in res])
        runs.append(got)
    assert runs[0] == runs[1]
