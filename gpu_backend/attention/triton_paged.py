"""Paged decode attention with a Triton kernel of our own: K/V are read in place from the pages.

A decode batch (every request adds one token, no BRLE rows) runs one kernel per layer. A program
handles one (request, KV head) pair and every query head of its group at once (GQA: the group's
rows are one [group, D] tile, padded to 16 rows for `tl.dot`): it walks the request's logical slots
in blocks of `block_n`, finds each slot's physical page through the request's row of an int32 page
table ([B, pages]), loads K and V rows straight from the cache layer ([slots, 2, KVH, D], slot =
page * page_size + offset) and keeps an online softmax in float32. A layer's `AttnSpec` applies:
`scale`, `softcap` (scores become cap * tanh(score / cap)) and, for sliding layers (`local`), the
window: the new token at logical slot len - 1 sees slots [len - window, len).

Split-KV (flash-decoding): with few requests and long contexts a grid of B x KVH programs leaves
most of the GPU idle, so each request's KV range is cut into `splits` chunks, one program each; they
write unnormalised partial outputs with their running max and sum, and a second small kernel merges
them. The split count is chosen on the host from the batch size and the KV length the batch is
padded to (`Layout.kv_slots`), never from the data, so it is fixed per CUDA graph.

Everything else falls back to `SdpaAttention` (its `prepare` builds the metadata, `attend`
delegates): prefill and mixed batches are compute-bound (a query tile of many rows is what SDPA's
kernels are built for; a decode kernel reading pages per row would redo the page walk per token),
and BRLE rows (`ForwardRequest.mask`) need a per-slot mask this kernel does not read.

CUDA graphs: under `Layout.static` the page table is `ceil(kv_slots / page_size)` pages wide, and
`kv_slots` is `graph_slots(max_len)` (powers of two from 64, as SDPA's), so the metadata's shapes
depend only on the batch bucket and that KV length; `attend` launches kernels and allocates
outputs of fixed shapes, with no host sync.

Triton is imported lazily (`gpu_backend.build.make_attention("triton")`). With `TRITON_INTERPRET=1`
the kernels run in Triton's interpreter on CPU tensors (slow, for checking only): the variable must
be set before triton is first imported (triton.language's own helpers, `tl.cdiv` and the
reductions, are wrapped when it loads), so tests/test_triton_attention.py runs those cases in a
fresh process. Our kernels are wrapped by `triton.jit` at their first launch, keyed by the flag.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - the message is what matters
    raise ValueError("the 'triton' attention needs the triton package: pip install triton (3.6.0 with torch "
                     "2.11 on CUDA), and a CUDA GPU (or TRITON_INTERPRET=1 to run its kernel on CPU, slowly, "
                     f"for testing): {e}") from None

from gpu_backend.attention import (
    GLOBAL,
    Attention,
    AttnSpec,
    BatchPlan,
    Layout,
    SdpaAttention,
    SdpaMeta,
    page_table,
    to_device,
)
from gpu_backend.types import ForwardRequest

MIN_ROWS = 16  # tl.dot wants at least 16 rows: a group's query heads are padded up to it
MAX_SPLITS = 32
NO_WINDOW = 2**30  # the kernel's window for global layers: longer than any sequence


@dataclass
class TritonMeta:
    """A decode batch's metadata (refilled in place under CUDA graphs)."""

    table: torch.Tensor  # [B, pages] int32: each request's physical pages in order, then zeros
    lens: torch.Tensor  # [B] int32: tokens in the sequence after this pass (the new one included)
    page_size: int
    window: int  # the sliding layers' window (0 = none)
    kv_slots: int  # the KV length the batch is padded to (what the split count is chosen from)


def _decode(q_ptr, kv_ptr, table_ptr, lens_ptr, out_ptr, acc_ptr, ml_ptr,
            stride_qn, stride_qh, stride_ks, stride_kv, stride_kh, stride_tb, stride_on,
            scale, softcap, window, page_size,
            GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PREC: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    num_kvh = tl.num_programs(1)
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < GROUP
    dim_ok = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + b * stride_qn + heads[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    length = tl.load(lens_ptr + b)
    lo = tl.maximum(length - window, 0)  # window: NO_WINDOW for global layers
    chunk = tl.cdiv(tl.cdiv(length - lo, SPLITS), BLOCK_N) * BLOCK_N
    start = lo + s * chunk
    end = tl.minimum(length, start + chunk)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        slot = n0 + cols  # logical slots of this block
        ok = slot < end
        page = tl.load(table_ptr + b * stride_tb + slot // page_size, mask=ok, other=0)
        phys = page.to(tl.int64) * page_size + slot % page_size
        base = kv_ptr + phys[:, None] * stride_ks + kvh * stride_kh + dims[None, :]
        kv_ok = ok[:, None] & dim_ok[None, :]
        k = tl.load(base, mask=kv_ok, other=0.0)
        v = tl.load(base + stride_kv, mask=kv_ok, other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale  # [BLOCK_G, BLOCK_N] fp32
        if SOFTCAP:
            # cap * tanh(sc / cap); tanh(x) = 1 - 2 / (exp(2x) + 1), exact at both ends in fp32
            sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * sc / softcap) + 1.0))
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2((m_i - m_new) * 1.4426950408889634)  # exp via exp2: log2(e)
        p = tl.exp2((sc - m_new[:, None]) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new

    if SPLITS == 1:
        o = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_on + heads[:, None] * HEAD_DIM + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    else:
        # partials [B, KVH, SPLITS, GROUP, HEAD_DIM] (unnormalised) and [B, KVH, SPLITS, 2, GROUP] (max, sum)
        part = ((b * num_kvh + kvh) * SPLITS + s).to(tl.int64)
        tl.store(acc_ptr + part * (GROUP * HEAD_DIM) + rows[:, None] * HEAD_DIM + dims[None, :], acc,
                 mask=row_ok[:, None] & dim_ok[None, :])
        tl.store(ml_ptr + part * (2 * GROUP) + rows, m_i, mask=row_ok)
        tl.store(ml_ptr + part * (2 * GROUP) + GROUP + rows, l_i, mask=row_ok)


def _combine(acc_ptr, ml_ptr, out_ptr, stride_on,
             GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
             BLOCK_D: tl.constexpr):
    """Split-KV: one program per (request, query head) merges its SPLITS partial outputs."""
    n = tl.program_id(0)
    head = tl.program_id(1)
    num_kvh = tl.num_programs(1) // GROUP
    kvh = head // GROUP
    g = head % GROUP
    ss = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    s_ok = ss < SPLITS
    dim_ok = dims < HEAD_DIM
    part = ((n * num_kvh + kvh) * SPLITS + ss).to(tl.int64)
    m = tl.load(ml_ptr + part * (2 * GROUP) + g, mask=s_ok, other=float("-inf"))
    lsum = tl.load(ml_ptr + part * (2 * GROUP) + GROUP + g, mask=s_ok, other=0.0)
    w = tl.exp(m - tl.max(m, 0))  # empty chunks (m = -inf) weigh 0; chunk 0 is never empty
    a = tl.load(acc_ptr + part[:, None] * (GROUP * HEAD_DIM) + g * HEAD_DIM + dims[None, :],
                mask=s_ok[:, None] & dim_ok[None, :], other=0.0)
    o = tl.sum(a * w[:, None], 0) / tl.sum(lsum * w, 0)
    tl.store(out_ptr + n * stride_on + head * HEAD_DIM + dims, o.to(out_ptr.dtype.element_ty), mask=dim_ok)


@functools.cache
def _jitted(interpret: bool) -> tuple[Any, Any]:
    # keyed by the interpreter flag: triton.jit picks the interpreter from TRITON_INTERPRET when it runs
    if interpret:
        _fix_interpreter_index()
    return triton.jit(_decode), triton.jit(_combine)


def _fix_interpreter_index() -> None:
    """Triton 3.6's interpreter holds scalars as 1-element 1-D numpy arrays and turns them into
    Python ints with `int(array)` (`range` over tensor bounds, as the kernel's KV loop), which numpy
    >= 2.3 refuses ("only 0-dimensional arrays can be converted"). Re-point its `__index__` patch
    at `.item()`; interpreter only, the compiled kernel never runs this."""
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_pie_fixed", False):
        return

    def patched(tensor: Any, scope: Any) -> None:
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._pie_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _kernels() -> tuple[Any, Any]:
    return _jitted(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@functools.cache
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class TritonAttention(Attention):
    """Decode batches through the paged Triton kernel above; other batches through SDPA.

    block_n: KV slots per loop step (any page size works: each slot finds its page). splits: KV
    chunks per (request, KV head); None = chosen per batch from the GPU's SM count (more programs
    than SMs x 2 and each chunk at least 2 blocks); 1 = never split.
    """

    name = "triton"

    def __init__(self, block_n: int = 64, splits: int | None = None, num_warps: int = 4) -> None:
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
        self.block_n = block_n
        self.splits = splits
        self.num_warps = num_warps
        self.sdpa = SdpaAttention()

    def graph_slots(self, max_len: int) -> int:
        return self.sdpa.graph_slots(max_len)

    @staticmethod
    def is_decode(reqs: list[ForwardRequest], lay: Layout) -> bool:
        """One new token per request and no BRLE rows: what the kernel serves."""
        return lay.max_tokens == 1 and lay.grid == (lay.batch, 1) and all(r.mask is None for r in reqs)

    def num_splits(self, batch: int, kvh: int, kv_slots: int, device: torch.device) -> int:
        """KV chunks per (request, KV head) for a decode batch: from shapes only (fixed per CUDA graph)."""
        if self.splits is not None:
            return max(1, self.splits)
        if device.type == "cuda":
            target = 2 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        else:
            target = 16
        programs = batch * kvh
        if programs >= target:
            return 1
        blocks = -(-kv_slots // self.block_n)
        return max(1, min(-(-target // programs), blocks // 2, MAX_SPLITS))

    def prepare(self, reqs: list[ForwardRequest], lay: Layout) -> TritonMeta | SdpaMeta:
        if not self.is_decode(reqs, lay):
            return self.sdpa.prepare(reqs, lay)
        if lay.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise ValueError(f"the 'triton' attention runs its kernel on a CUDA GPU, the batch is on {lay.device} "
                             "(set TRITON_INTERPRET=1 to run it in Triton's interpreter on CPU, slowly)")
        ps = lay.page_size
        width = -(-lay.kv_slots // ps)
        table = page_table(reqs, width)[:, :width].astype(np.int32)
        return TritonMeta(table=to_device(table, lay.device), lens=to_device(lay.lens.astype(np.int32), lay.device),
                          page_size=ps, window=lay.window, kv_slots=lay.kv_slots)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, plan: BatchPlan, spec: AttnSpec = GLOBAL) -> torch.Tensor:
        if isinstance(plan.meta, SdpaMeta):
            return self.sdpa.attend(q, kv, plan, spec)
        meta = cast(TritonMeta, plan.meta)
        n, h, d = q.shape
        kvh = kv.shape[2]
        group = h // kvh
        if q.stride(2) != 1:
            q = q.contiguous()
        if kv.stride(3) != 1:
            raise ValueError("the 'triton' attention needs the cache's head_dim axis contiguous")
        scale = d ** -0.5 if spec.scale is None else spec.scale
        window = meta.window if spec.local and meta.window > 0 else NO_WINDOW
        splits = self.num_splits(n, kvh, meta.kv_slots, q.device)
        out = torch.empty(n, h * d, dtype=q.dtype, device=q.device)
        if splits > 1:
            acc = torch.empty(n, kvh, splits, group, d, dtype=torch.float32, device=q.device)
            ml = torch.empty(n, kvh, splits, 2, group, dtype=torch.float32, device=q.device)
        else:
            acc = ml = out  # unused
        block_d = max(16, _next_pow2(d))
        block_n = self.block_n
        while block_n > 16 and block_n * block_d * q.element_size() > 32768:
            block_n //= 2  # K/V tiles of at most 32 KB (fp32 at head_dim 256: 32 rows), as stages multiply them
        decode, combine = _kernels()
        decode[(n, kvh, splits)](
            q, kv, meta.table, meta.lens, out, acc, ml,
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), meta.table.stride(0), out.stride(0),
            float(scale), float(spec.softcap or 0.0), window, meta.page_size,
            GROUP=group, HEAD_DIM=d, BLOCK_G=max(MIN_ROWS, _next_pow2(group)), BLOCK_D=block_d,
            BLOCK_N=block_n, SPLITS=splits, SOFTCAP=spec.softcap is not None,
            DOT_PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=self.num_warps,
        )
        if splits > 1:
            combine[(n, h)](acc, ml, out, out.stride(0), GROUP=group, HEAD_DIM=d, SPLITS=splits,
                            BLOCK_S=max(2, _next_pow2(splits)), BLOCK_D=block_d, num_warps=1)
        return out

