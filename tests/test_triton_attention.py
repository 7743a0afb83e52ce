"""The paged Triton decode attention (gpu_backend/attention/triton_paged.py): what runs without
launching the kernel here, the kernel's cases in Triton's interpreter in a subprocess
(tests/triton_interp_cases.py: TRITON_INTERPRET=1 must be set before triton is first imported,
which this pytest process, or an xdist worker that ran inductor or flex first, cannot promise), and
the compiled kernel on CUDA (`gpu`).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from backend_checks import decode_batch, req

from gpu_backend.attention import AttnSpec, SdpaAttention, SdpaMeta, brle_row, build_plan

pytest.importorskip("triton")

from gpu_backend.attention.triton_paged import TritonAttention, TritonMeta  # noqa: E402

CPU = torch.device("cpu")
CASES = Path(__file__).with_name("triton_interp_cases.py")
WINDOW = 7
SPECS = [AttnSpec(), AttnSpec(local=True), AttnSpec(scale=0.37, softcap=1.5), AttnSpec(local=True, softcap=3.0)]


def run_cases(select: str) -> None:
    """Run tests/triton_interp_cases.py's cases matching `select` (pytest -k) in Triton's interpreter."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "-k", select, str(CASES)], env=env, cwd=CASES.parent.parent, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, f"interpreter cases failed:\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}"
    assert " passed" in p.stdout and " failed" not in p.stdout, p.stdout[-2000:]


@pytest.mark.heavy  # ~8 s of a subprocess interpreting the kernels: `make test` runs it, not test-fast
def test_kernel_equals_sdpa_in_the_interpreter():
    # random paged caches, GQA 1/2/4, window, soft-cap, scale, split-KV, page sizes 1/3/16, static
    # (graph) metadata: a few cases of each, the whole matrix in the heavy test below
    run_cases("quick or page_sizes or static")


@pytest.mark.heavy
def test_kernel_matrix_and_greedy_decode_in_the_interpreter():
    # every GQA group x spec x split count; a tiny random Llama (plain; window + soft-cap + scale):
    # greedy tokens and logits equal SDPA's, eager and through the CUDA-graph static buffers on CPU
    run_cases("matrix or greedy")


def test_decode_metadata_is_static_under_graphs(monkeypatch):
    # what a captured CUDA graph needs: two decode batches of one size padded to one graph_slots
    # build tensors of the same shapes (table width = kv_slots / page_size, int32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # prepare checks for it on CPU; nothing is launched
    attn = TritonAttention()
    rng = np.random.default_rng(5)
    shapes = []
    for lens in ([1, 30], [17, 64]):
        slots = attn.graph_slots(max(lens))
        meta = build_plan(decode_batch(rng, lens, 4, 64), 4, CPU, 2, attn, num_pages=64, kv_slots=slots,
                          static=True).meta
        assert isinstance(meta, TritonMeta) and meta.table.dtype == meta.lens.dtype == torch.int32
        shapes.append((meta.table.shape, meta.lens.shape))
    assert shapes[0] == shapes[1] == ((2, 16), (2,))
    assert attn.graph_slots(65) == 128


def test_prefill_and_brle_batches_fall_back_to_sdpa():
    # more than one new token, or BRLE rows: the SDPA path's metadata, and SDPA's numbers
    ps, num_pages, kvh, d, group = 4, 32, 2, 16, 2
    g = torch.Generator().manual_seed(1)
    kv = torch.randn(num_pages * ps, 2, kvh, d, generator=g)
    prefill = [req([3, 9, 1], 5, [1, 2, 3], ps), req([4], 0, [1], ps)]
    brle = [req([7, 2], 4, [1], ps, mask=[[2, 1, 2]])]
    assert brle_row([2, 1, 2]).tolist() == [True, True, False, True, True]
    for reqs in (prefill, brle):
        n = sum(len(r.tokens) for r in reqs)
        q = torch.randn(n, kvh * group, d, generator=g)
        plans = [build_plan(reqs, ps, CPU, group, a, num_pages=num_pages) for a in (SdpaAttention(), TritonAttention())]
        assert isinstance(plans[1].meta, SdpaMeta)
        torch.testing.assert_close(plans[1].attend(q, kv), plans[0].attend(q, kv), rtol=0, atol=0)


def test_cpu_without_the_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reqs = decode_batch(np.random.default_rng(0), [5], 4, 8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        build_plan(reqs, 4, CPU, 1, TritonAttention(), num_pages=8)
    with pytest.raises(ValueError, match="block_n"):
        TritonAttention(block_n=24)


def test_make_attention_and_a_missing_triton(monkeypatch):
    from gpu_backend.build import ATTENTION_NAMES, make_attention

    assert "triton" in ATTENTION_NAMES
    assert isinstance(make_attention("triton"), TritonAttention)
    # without triton: a ValueError naming the fix (the module is imported afresh, then put back)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "gpu_backend.attention.triton_paged")
    with pytest.raises(ValueError, match="pip install triton") as e:
        importlib.import_module("gpu_backend.attention.triton_paged")
    assert "CUDA GPU" in str(e.value)
    with pytest.raises(ValueError, match="pip install triton"):
        make_attention("triton")


def signature(fn, dtype: str) -> dict[str, str]:
    """Triton types of a kernel's parameters: pointers by name, constexprs by annotation."""
    import inspect

    sig = {}
    for name, p in inspect.signature(fn).parameters.items():
        if "constexpr" in str(p.annotation):
            sig[name] = "constexpr"
        elif name in ("table_ptr", "lens_ptr"):
            sig[name] = "*i32"
        elif name in ("acc_ptr", "ml_ptr"):
            sig[name] = "*fp32"
        elif name.endswith("_ptr"):
            sig[name] = f"*{dtype}"
        else:
            sig[name] = "fp32" if name in ("scale", "softcap") else "i32"
    return sig


@pytest.mark.heavy
def test_kernels_compile_for_an_h100_h200_without_a_gpu():
    # the interpreter runs the kernel's Python, not Triton's compiler: compile both kernels to sm_90
    # cubins here (the wheel ships ptxas), so a construct the GPU compiler rejects fails on CPU too
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from gpu_backend.attention.triton_paged import _combine, _decode, _jitted

    decode, combine = _jitted(False)
    target = GPUTarget("cuda", 90, 32)
    for dtype, group, d, splits, softcap in (("bf16", 4, 64, 1, False), ("bf16", 2, 128, 4, True),
                                             ("fp32", 1, 80, 3, False)):
        const = dict(GROUP=group, HEAD_DIM=d, BLOCK_G=16, BLOCK_D=1 << (d - 1).bit_length(), BLOCK_N=64,
                     SPLITS=splits, SOFTCAP=softcap, DOT_PREC="ieee" if dtype == "fp32" else "tf32")
        k = compile(ASTSource(fn=decode, signature=signature(_decode, dtype), constexprs=const), target=target,
                    options={"num_warps": 4})
        assert k.asm.get("cubin"), "no cubin"
        const = dict(GROUP=group, HEAD_DIM=d, SPLITS=splits, BLOCK_S=max(2, 1 << (splits - 1).bit_length()),
                     BLOCK_D=1 << (d - 1).bit_length())
        compile(ASTSource(fn=combine, signature=signature(_combine, dtype), constexprs=const), target=target,
                options={"num_warps": 1})


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_kernel_on_cuda(monkeypatch, dtype):
    # the compiled kernel (not the interpreter) against SDPA on the GPU, GQA 4, page size 16, long
    # and short contexts, split and not
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    dev = torch.device("cuda")
    ps, num_pages, kvh, group, d = 16, 512, 8, 4, 64
    rng = np.random.default_rng(0)
    reqs = decode_batch(rng, [1, 15, 16, 17, 300, 2000, 4096, 777], ps, num_pages)
    g = torch.Generator(device=dev).manual_seed(0)
    kv = torch.randn(num_pages * ps, 2, kvh, d, generator=g, device=dev).to(dtype)
    q = torch.randn(len(reqs), kvh * group, d, generator=g, device=dev).to(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for spec in SPECS:
        for attn in (TritonAttention(), TritonAttention(splits=1), TritonAttention(splits=8)):
            outs = [a.attend(q, kv, build_plan(reqs, ps, dev, group, a, num_pages=num_pages, window=WINDOW), spec)
                    for a in (SdpaAttention(), attn)]
            torch.testing.assert_close(outs[1].float(), outs[0].float(), **tol)  # type: ignore[arg-type]
