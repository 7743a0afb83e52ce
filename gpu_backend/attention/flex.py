"""Paged attention through torch's FlexAttention: K/V are read in place from the pages, never gathered.

K and V of a layer are the whole cache viewed as one sequence of `num_pages * page_size` slots. The
block mask's KV blocks are pages (KV block size = page size): row tile `q` of request `b` lists the
physical pages it reads, split into full pages (every row of the tile sees every slot: no mask work)
and partial ones (the diagonal of a prefill, a last page not yet full, BRLE rows), where `mask_mod`
decides per slot. `mask_mod` only sees physical slot numbers, so it maps them back through a
[B, num_pages] table (physical page -> its index in the request's page list) before applying
causality (row t of a request sees logical slots up to ctx + t) or the BRLE rows (`allowed`, one
row per query).

A model with a sliding window gets a second block mask for its sliding layers (`FlexMeta.local`):
`mask_mod` also hides slots at or before `ctx + t - window`, and pages wholly before the window of
a row tile are not listed. Soft-capped scores go through a `score_mod` (one per cap value).

Invariants: `mask_mod` alone is exact (eager flex_attention ignores the block lists), the block
lists only skip work. Every row of a real request sees at least one slot; padding rows inside a row
tile with real rows act as the request's last row (causal) or see slot 0 (BRLE); row tiles of
padding only, and padding requests, list no page (their output is dropped, never read).

Compiled (the default): on CPU one kernel per page size, cache size, mask kind (causal / BRLE) and
padded shape bucket (`FlexAttention.grid`), as dynamic shapes miscompile there; elsewhere dynamic
shapes. Each CPU kernel takes ~4 s to compile (cached on disk by inductor across runs).

Measured on CPU (bench/flex_attention.py) and on one H100 (bench/gpu_h100.md: slower than SDPA with
CUDA graphs at every batch size; a batch-1 decode does not compile there, see `_compiled_flex`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, cast

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from gpu_backend.attention import (
    GLOBAL,
    Attention,
    AttnSpec,
    BatchPlan,
    Layout,
    allowed_mask,
    page_table,
    to_device,
)
from gpu_backend.types import ForwardRequest

Q_BLOCK = 128  # query rows per block-mask row tile
# static-shape buckets (CPU): query length rounds up to a power of two at least MIN_TOKENS, the BRLE
# grid's width to a power of two of pages covering at least MIN_BRLE_SLOTS slots
MIN_TOKENS, MIN_BRLE_SLOTS = 64, 256
# Graphs per compiled code object before dynamo gives up and runs eagerly: page sizes x mask kinds x
# shape classes can pass torch's default of 8 in one process (the tests use three page sizes).
RECOMPILE_LIMIT = 64

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]



@cache
def _compiled_flex(dynamic: bool | None) -> Callable[..., Any]:
    """flex_attention through torch.compile, made once per process on first use and shared by every
    FlexAttention (and so are their kernels). Made lazily: `torch.compile` imports dynamo and
    inductor, ~2-4 s, which importing this module should not cost. `dynamic=False` for static
    shapes (CUDA graphs), None otherwise.

    Known on CUDA (H100, torch 2.11; bench/gpu_h100.json): a decode batch of ONE request fails to
    compile ("NoValidChoicesError ... target: flex_attention"), with dynamic=None and dynamic=True
    alike; batches of 8 and more run. SDPA (+ CUDA graphs) is the CUDA default, faster at every batch."""
    return cast(Callable[..., Any], torch.compile(flex_attention, dynamic=dynamic))


@dataclass
class FlexBlocks:
    """One block mask and the tensors it reads (refilled in place under CUDA graphs)."""

    block_mask: BlockMask
    kv_num: torch.Tensor  # [B, 1, NQ] int32: partial pages per row tile
    kv_idx: torch.Tensor  # [B, 1, NQ, width] int32: their physical page ids (first kv_num valid)
    full_num: torch.Tensor  # [B, 1, NQ] int32: full pages per row tile
    full_idx: torch.Tensor  # [B, 1, NQ, width] int32
    allowed: torch.Tensor | None  # [B, T, W] bool: logical slots row t sees (batches with BRLE rows)


@dataclass
class FlexMeta:
    """A batch's block masks (all layers; the sliding layers') and the tensors they share."""

    blocks: FlexBlocks
    local: FlexBlocks | None  # the sliding layers' (None when the model has no window)
    p2l: torch.Tensor  # [B, P] int32: index of physical page p in request b's pages, -1 = not its page
    ctx: torch.Tensor | None  # [B] int32: cached tokens before the pass (causal batches)
    last: torch.Tensor | None  # [B] int32: last real query row; padding rows act as it (causal batches)


def _causal_mod(p2l: torch.Tensor, ctx: torch.Tensor, last: torch.Tensor, ps: int, window: int = 0) -> MaskMod:
    # ctx + min(q, last) rather than a [B, T] table: indexing a table by q miscompiles in inductor's
    # CPU template at T == 1 (torch 2.13: "'cur_qSplitSize0' was not declared in this scope")
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lg = p2l[b, kv // ps] * ps + kv % ps
        return (lg >= 0) & (lg <= ctx[b] + torch.minimum(q, last[b]))

    def window_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lg = p2l[b, kv // ps] * ps + kv % ps
        lim = ctx[b] + torch.minimum(q, last[b])
        return (lg >= 0) & (lg <= lim) & (lg > lim - window)

    return window_mod if window > 0 else mask_mod


@cache
def _softcap_mod(cap: float) -> Callable[..., torch.Tensor]:
    """score_mod of scores soft-capped at `cap` (one function per value, so compiled kernels are reused)."""
    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q: torch.Tensor,
                  kv: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod


def _brle_mod(p2l: torch.Tensor, allowed: torch.Tensor, ps: int) -> MaskMod:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        lg = p2l[b, kv // ps] * ps + kv % ps
        # lg < W always: a request's pages hold at most W = max pages * page_size slots
        return (lg >= 0) & allowed[b, q, lg.clamp(min=0)]

    return mask_mod


def _causal_blocks(lay: Layout, npg: np.ndarray, nq: int, maxpg: int,
                   window: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The (needed, full) page flags [B, NQ, maxpg] of a causal batch (B requests); `window` > 0:
    of its sliding layers."""
    t = lay.grid[1]
    rows = np.minimum(np.arange(t)[None, :], lay.n_tok[:, None] - 1)  # padding rows act as the last row
    lim = lay.ctx[:, None] + rows
    lo = np.arange(nq) * Q_BLOCK
    hi = np.minimum(lo + Q_BLOCK, t) - 1
    lim_lo = lim[:, lo][:, :, None]  # rows only grow, so the tile's first row sees the least
    lim_hi = lim[:, hi][:, :, None]
    first = np.arange(maxpg)[None, None, :] * lay.page_size
    last_slot = first + lay.page_size - 1
    need = (first <= lim_hi) & (np.arange(maxpg)[None, None, :] < npg[:, None, None])
    full = need & (last_slot <= lim_lo)
    if window > 0:  # the tile's last row sees the least far back
        need &= last_slot > lim_lo - window
        full &= first > lim_hi - window
    return need, full


def _brle_blocks(allowed: np.ndarray, nq: int, maxpg: int, ps: int) -> tuple[np.ndarray, np.ndarray]:
    """(needed, full) page flags [B, NQ, maxpg] from the [B, T, maxpg * ps] allowed grid."""
    b, t, _ = allowed.shape
    pad = nq * Q_BLOCK - t  # rows past T do not exist: neutral for any() and all()
    grid = allowed.reshape(b, t, maxpg, ps)
    any_ = np.pad(grid, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=False)
    all_ = np.pad(grid, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=True)
    need = np.asarray(any_.reshape(b, nq, Q_BLOCK, maxpg, ps).any(axis=(2, 4)))
    full = np.asarray(all_.reshape(b, nq, Q_BLOCK, maxpg, ps).all(axis=(2, 4)))
    return need, full


def _page_lists(sel: np.ndarray, pages: np.ndarray, rows: int, width: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected pages [B, NQ, maxpg] -> (count [rows, 1, NQ], physical ids [rows, 1, NQ, width]) int32.

    Rows past B (batch padding) list no page; only the first `count` ids of a row are read.
    """
    b, nq, maxpg = sel.shape
    order = np.argsort(~sel, axis=-1, kind="stable")  # selected pages first, in page order
    ids = np.take_along_axis(np.broadcast_to(pages[:, None, :], sel.shape), order, axis=-1)
    idx = torch.zeros(rows, 1, nq, width, dtype=torch.int32, device=device)
    idx[:b, 0, :, :maxpg] = to_device(ids.astype(np.int32), device)
    count = np.zeros((rows, 1, nq), dtype=np.int32)
    count[:b, 0] = sel.sum(-1)
    return to_device(count, device), idx


def _bucket(n: int, least: int = 1) -> int:
    """n rounded up to a power of two, at least `least`."""
    return max(least, 1 << (n - 1).bit_length())


class FlexAttention(Attention):
    """Paged attention with `torch.nn.attention.flex_attention` over the cache in place.

    compile: run flex_attention through `torch.compile` (the fast path; the eager one materialises
    scores over the whole cache and is only good for checking). static_shapes: compile one kernel
    per padded shape bucket (batch, query length and BRLE width rounded up to powers of two) instead
    of one dynamic-shape kernel; None = static on CPU, dynamic elsewhere. On CPU dynamic shapes
    miscompile in torch 2.13: inductor's flex template renames its row-split size variable by
    plain text replacement, so `ks1` also rewrites `ks18` ("error: 'cur_qSplitSize8' was not
    declared in this scope"), which happens as soon as the kernel has more than ten size variables.
    min_batch: the smallest batch bucket with static shapes. Padding requests are not free in the
    CPU kernel (batch 1 padded to 4 ran its attention ~2x slower), so 1 is the default; a larger
    one means fewer kernels to compile.
    """

    name = "flex"

    def __init__(self, compile: bool = True, static_shapes: bool | None = None, min_batch: int = 1) -> None:
        self.compiled = compile
        self.static_shapes = static_shapes
        self.min_batch = min_batch

    def _static(self, device: torch.device) -> bool:
        if not self.compiled:
            return False
        return device.type == "cpu" if self.static_shapes is None else self.static_shapes

    def grid(self, batch: int, tokens: int, device: torch.device) -> tuple[int, int]:
        if not self._static(device):
            return batch, tokens
        # few buckets, few kernels (each compile takes seconds): padding requests read no page, and
        # padding rows only add work inside a row tile that has real rows
        return _bucket(batch, self.min_batch), 1 if tokens == 1 else _bucket(tokens, MIN_TOKENS)

    def prepare(self, reqs: list[ForwardRequest], lay: Layout) -> FlexMeta:
        ps, npages, dev = lay.page_size, lay.num_pages, lay.device
        if npages < 1:
            raise ValueError("FlexAttention needs the cache's physical page count (build_plan num_pages)")
        rows, t = lay.grid
        b = lay.batch
        nq = -(-t // Q_BLOCK)
        npg = np.asarray([len(r.pages) for r in reqs], dtype=np.int64)
        maxpg = int(npg.max())
        if self._static(dev):  # the BRLE grid's width is part of the kernel's shapes
            maxpg = min(_bucket(maxpg, max(1, MIN_BRLE_SLOTS // ps)), npages)
        pages = page_table(reqs, maxpg)[:, :maxpg]
        valid = np.arange(maxpg)[None, :] < npg[:, None]
        p2l = torch.full((rows, npages), -1, dtype=torch.int32, device=dev)
        ri, ci = np.nonzero(valid)
        p2l[to_device(ri, dev), to_device(pages[valid], dev)] = to_device(ci.astype(np.int32), dev)

        ctx_t = last_t = None
        brle = any(r.mask is not None for r in reqs)
        if not brle:
            ctx = np.zeros(rows, dtype=np.int32)
            ctx[:b] = lay.ctx
            last = np.zeros(rows, dtype=np.int32)
            last[:b] = lay.n_tok - 1
            ctx_t, last_t = to_device(ctx, dev), to_device(last, dev)

        def blocks(window: int) -> FlexBlocks:
            allowed_t = None
            if brle:
                allowed = np.zeros((rows, t, maxpg * ps), dtype=bool)
                allowed[:b] = allowed_mask(reqs, lay, maxpg * ps, window)
                need, full = _brle_blocks(allowed[:b], nq, maxpg, ps)
                allowed_t = to_device(allowed, dev)
                mask_mod = _brle_mod(p2l, allowed_t, ps)
            else:
                assert ctx_t is not None and last_t is not None  # set for causal batches above
                need, full = _causal_blocks(lay, npg, nq, maxpg, window)
                mask_mod = _causal_mod(p2l, ctx_t, last_t, ps, window)
            return self._blocks(lay, need, full, pages, mask_mod, allowed_t, nq)

        local = blocks(lay.window) if lay.window > 0 else None
        return FlexMeta(blocks=blocks(0), local=local, p2l=p2l, ctx=ctx_t, last=last_t)

    @staticmethod
    def _blocks(lay: Layout, need: np.ndarray, full: np.ndarray, pages: np.ndarray, mask_mod: MaskMod,
                allowed: torch.Tensor | None, nq: int) -> FlexBlocks:
        rows, t = lay.grid
        ps, npages, dev = lay.page_size, lay.num_pages, lay.device
        # row tiles made only of padding rows read nothing (their output is dropped)
        live = (np.arange(nq) * Q_BLOCK)[None, :, None] < lay.n_tok[:, None, None]
        need, full = need & live, full & live
        # id rows as wide as the cache on CPU (inductor's CPU kernel asserts `width * page_size >= KV
        # length`) and under CUDA graphs (fixed shapes); elsewhere as wide as the longest page list
        width = npages if dev.type == "cpu" or lay.static else pages.shape[1]
        kv_num, kv_idx = _page_lists(need & ~full, pages, rows, width, dev)
        full_num, full_idx = _page_lists(full, pages, rows, width, dev)
        # full blocks are always passed (possibly none): inductor's CPU template fails to compile
        # without them (torch 2.13: "'full_kv_num_blocks' was not declared in this scope")
        block_mask = BlockMask.from_kv_blocks(
            kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, ps), mask_mod=mask_mod,
            seq_lengths=(t, npages * ps), compute_q_blocks=False,
        )
        return FlexBlocks(block_mask=block_mask, kv_num=kv_num, kv_idx=kv_idx, full_num=full_num,
                          full_idx=full_idx, allowed=allowed)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, plan: BatchPlan, spec: AttnSpec = GLOBAL) -> torch.Tensor:
        meta = cast(FlexMeta, plan.meta)
        blocks = meta.local if spec.local and meta.local is not None else meta.blocks
        n, h, d = q.shape
        b, t = plan.batch, plan.max_tokens
        # contiguous either way: the kernel is compiled for the query's strides too
        qp = (q.contiguous() if plan.q_index is None else q[plan.q_index]).view(b, t, h, d).transpose(1, 2)
        # [slots, 2, KVH, D] -> [B, KVH, slots, D] views of the cache (batch stride 0): no copy
        k = kv[:, 0].permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1)
        v = kv[:, 1].permute(1, 0, 2).unsqueeze(0).expand(b, -1, -1, -1)
        if not self.compiled:
            fn: Callable[..., Any] = flex_attention
        else:
            fn = _compiled_flex(False if self._static(q.device) else None)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            o = fn(qp, k, v, block_mask=blocks.block_mask, enable_gqa=k.shape[1] != h, scale=spec.scale,
                   score_mod=None if spec.softcap is None else _softcap_mod(spec.softcap),
                   kernel_options=_kernel_options(q.device, blocks.block_mask.BLOCK_SIZE[1]))
        o = o.transpose(1, 2).reshape(b * t, h * d)
        return o if plan.o_index is None else o[plan.o_index]


def _kernel_options(device: torch.device, page_size: int) -> dict[str, int] | None:
    """Triton's flex kernels need KV tiles that divide the KV block (= page) size; CPU needs nothing.

    Run on an H100 with page size 16 (bench/gpu_h100.md); a page size under 16 likely fails there
    (Triton's dot wants >= 16).
    """
    if device.type != "cuda":
        return None
    return {"BLOCK_N": min(page_size & -page_size, 64)}  # largest power of two dividing the page size
