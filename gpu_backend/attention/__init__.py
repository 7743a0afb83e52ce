"""Batch plan (token indices, write slots) built once per forward, and the attention paths it drives.

All requests of a batch are laid out as a padded [B, T] grid of queries. How they attend over the
paged cache is an `Attention`: `SdpaAttention` (the default) gathers each request's KV slots into a
padded [B, L] copy and runs one SDPA call per layer with the per-token masks (causal or BRLE) folded
into one boolean mask; `gpu_backend.attention.flex.FlexAttention` reads the pages in place through a block mask.
Both build their metadata once per batch (`prepare`) and reuse it in every layer (`attend`).

A model with a sliding window (`Layout.window`) gets a second set of masks for its sliding layers,
built alongside the first: a query in logical slot s sees slots `(s - window, s]` (also under BRLE
rows, intersected with them). Each layer says which set it uses, and its softmax scale and score
soft-capping, with an `AttnSpec`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from itertools import chain
from typing import ClassVar, cast

import numpy as np
import torch
import torch.nn.functional as F

from gpu_backend.types import ForwardRequest


@dataclass(frozen=True)
class AttnSpec:
    """How one layer attends: `local` = through the sliding-window masks; `scale` = softmax scale
    (None = head_dim ** -0.5); `softcap` = scores become cap * tanh(score / cap) before the mask."""

    local: bool = False
    scale: float | None = None
    softcap: float | None = None


GLOBAL = AttnSpec()


@dataclass(frozen=True)
class Layout:
    """The geometry of a batch, host side: what `Attention.prepare` builds its metadata from.

    `kv_slots`: length of the KV axis the SDPA path gathers (>= every request's length; larger only
    when padded to a CUDA-graph bucket). `static`: metadata must have shapes that depend only on the
    batch size and `kv_slots` (a captured graph's buffers are refilled in place). `grid`: the padded
    [batch, tokens] query grid, from `Attention.grid` (rows past the requests are padding).
    """

    ctx: np.ndarray  # [B] tokens already cached before this pass
    n_tok: np.ndarray  # [B] new tokens
    lens: np.ndarray  # [B] ctx + n_tok
    page_size: int
    num_pages: int  # physical pages in the cache (the caller's pages plus any scratch page)
    group: int  # query heads per KV head
    device: torch.device
    kv_slots: int
    grid: tuple[int, int]
    static: bool = False
    window: int = 0  # the sliding layers' window (0 = the model has none)

    @property
    def batch(self) -> int:
        return len(self.n_tok)

    @property
    def max_tokens(self) -> int:
        return int(self.n_tok.max())


@dataclass
class BatchPlan:
    tokens: torch.Tensor  # [N] new tokens of all requests, concatenated
    positions: torch.Tensor  # [N]
    write_slots: torch.Tensor  # [N] cache slot of each new token
    q_index: torch.Tensor | None  # [B*T] token row for each query row of the grid; None if no padding
    o_index: torch.Tensor | None  # [N] grid row of each token; None if no padding
    batch: int  # B: rows of the query grid (requests, plus padding if the attention asks for it)
    max_tokens: int  # T: columns of the query grid
    output_rows: torch.Tensor  # [M] token rows whose logits are wanted
    attention: Attention
    meta: object  # what `attention.prepare` built for this batch

    def attend(self, q: torch.Tensor, kv: torch.Tensor, spec: AttnSpec = GLOBAL) -> torch.Tensor:
        """q: [N, H, D]; kv: one layer of the cache [slots, 2, KVH, D] (new tokens already written).
        Returns [N, H * D]."""
        return self.attention.attend(q, kv, self, spec)


class Attention(ABC):
    """How a batch attends over the paged cache.

    `prepare` runs once per batch, `attend` once per layer. Metadata prepared from two layouts with
    the same batch size and `graph_slots` has tensors of the same shapes (what a CUDA graph needs).
    """

    name: ClassVar[str]

    @abstractmethod
    def prepare(self, reqs: list[ForwardRequest], lay: Layout) -> object:
        """Per-batch metadata (on `lay.device`) for `attend`."""

    @abstractmethod
    def attend(self, q: torch.Tensor, kv: torch.Tensor, plan: BatchPlan, spec: AttnSpec = GLOBAL) -> torch.Tensor:
        """q: [N, H, D] new tokens' queries; kv: one layer's cache [slots, 2, KVH, D]; spec: the layer's
        window, scale and soft-cap. Returns [N, H * D]."""

    def graph_slots(self, max_len: int) -> int:
        """The KV-axis length a CUDA graph for a batch whose longest request has `max_len` tokens is
        captured at; 0 = the metadata does not depend on it."""
        return 0

    def grid(self, batch: int, tokens: int, device: torch.device) -> tuple[int, int]:
        """The [B, T] query grid for `batch` requests of at most `tokens` new tokens (padded up to
        fixed buckets by an attention that compiles one kernel per shape)."""
        return batch, tokens


def to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device`. On CUDA the copy is queued without a host sync (from
    pageable memory CUDA stages the bytes before the call returns, so `a` may be freed at once): a
    batch's plan is built while the batch before it still runs."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def page_table(reqs: list[ForwardRequest], width: int = 0) -> np.ndarray:
    """[B, max(width, longest page list)] int64: row i = request i's pages, then zeros. A few numpy
    calls for any batch size (a decode step of 256 requests builds its plan in well under a ms)."""
    npg = np.fromiter((len(r.pages) for r in reqs), dtype=np.int64, count=len(reqs))
    flat = np.fromiter(chain.from_iterable(r.pages for r in reqs), dtype=np.int64, count=int(npg.sum()))
    table = np.zeros((len(reqs), max(width, int(npg.max()))), dtype=np.int64)
    table[np.arange(table.shape[1])[None, :] < npg[:, None]] = flat  # row-major: each row's pages in order
    return table


def write_slots(reqs: list[ForwardRequest], page_size: int, ctx: np.ndarray, n_tok: np.ndarray) -> np.ndarray:
    """The cache slot each new token of the batch is written to, in token order."""
    rows = np.repeat(np.arange(len(reqs)), n_tok)
    starts = np.cumsum(n_tok) - n_tok
    pos = np.arange(int(n_tok.sum())) - np.repeat(starts - ctx, n_tok)  # each token's logical slot
    return page_table(reqs)[rows, pos // page_size] * page_size + pos % page_size


def brle_row(runs: list[int]) -> np.ndarray:
    """Expand BRLE run lengths (attend, masked, attend, ...) into a boolean row."""
    flags = np.zeros(len(runs), dtype=bool)
    flags[0::2] = True
    return np.repeat(flags, runs)


def allowed_mask(reqs: list[ForwardRequest], lay: Layout, width: int, window: int = 0) -> np.ndarray:
    """[B, T, width] bool (B requests, T grid columns), True = query row t of request b attends to
    its logical KV slot j.

    Causal (row t sees slots up to ctx + t) unless the request carries BRLE rows; `window` > 0 also
    hides slots at or before ctx + t - window. Padding rows (t >= n_tok) see slot 0 only, so no row
    is empty (no NaN) and their output is dropped anyway.
    """
    rows = np.arange(lay.grid[1])[None, :, None]
    cols = np.arange(width)[None, None, :]
    c = lay.ctx[:, None, None]
    t = lay.n_tok[:, None, None]
    mask = np.where(rows < t, cols <= c + rows, cols == 0)
    for i, r in enumerate(reqs):
        if r.mask is not None:
            for row, runs in enumerate(r.mask):
                mask[i, row, : lay.ctx[i] + row + 1] = brle_row(runs)
    if window > 0:
        mask &= (cols > c + rows - window) | (rows >= t)
    return mask


def build_plan(reqs: list[ForwardRequest], page_size: int, device: torch.device, group: int = 1,
               attention: Attention | None = None, num_pages: int = 0, kv_slots: int = 0,
               static: bool = False, all_rows: bool = False, window: int = 0, rope_switch: int = 0) -> BatchPlan:
    """Index tensors and attention metadata for a batch of validated requests.

    `group` = query heads per KV head; `num_pages` = physical pages in the cache (FlexAttention
    addresses the whole cache); `kv_slots` / `static` / `window`: see `Layout`; `all_rows`: logits at
    every token row instead of the requested outputs (a CUDA graph computes all rows of its bucket).
    `rope_switch` > 0 (longrope's `ModelConfig.long_rope_from`): the positions of a request whose last
    position reaches it are moved up by it, to the model's long-factor RoPE rows.
    """
    attention = attention if attention is not None else SdpaAttention()
    n_tok = np.asarray([len(r.tokens) for r in reqs], dtype=np.int64)
    ctx = np.asarray([r.context_len(page_size) for r in reqs], dtype=np.int64)
    lens = ctx + n_tok
    b, t_max = attention.grid(len(reqs), int(n_tok.max()), device)
    lay = Layout(ctx=ctx, n_tok=n_tok, lens=lens, page_size=page_size, num_pages=num_pages, group=group,
                 device=device, kv_slots=max(kv_slots, int(lens.max())), grid=(b, t_max), static=static,
                 window=window)

    write = write_slots(reqs, page_size, ctx, n_tok)

    q_index = o_index = None
    if int(n_tok.min()) != t_max or b != len(reqs):
        starts = np.concatenate([[0], np.cumsum(n_tok)[:-1]])
        cols = np.arange(t_max)[None, :]
        rows = np.zeros((b, t_max), dtype=np.int64)  # padding requests read token row 0
        rows[: len(reqs)] = starts[:, None] + np.minimum(cols, n_tok[:, None] - 1)
        q_index = to_device(rows.ravel(), device)
        o_index = to_device(np.concatenate([i * t_max + np.arange(n) for i, n in enumerate(n_tok)]), device)

    if all_rows:
        out_rows = np.arange(int(n_tok.sum()))
    else:
        starts_out = np.concatenate([[0], np.cumsum(n_tok)[:-1]])
        out_rows = np.asarray([s + o.index for r, s in zip(reqs, starts_out, strict=True) for o in r.outputs],
                              dtype=np.int64)

    def as_long(x: list[int] | np.ndarray) -> torch.Tensor:
        return to_device(np.asarray(x, dtype=np.int64), device)

    if rope_switch:
        positions = [p + (rope_switch if max(r.positions) >= rope_switch else 0) for r in reqs for p in r.positions]
    else:
        positions = [p for r in reqs for p in r.positions]
    return BatchPlan(
        tokens=as_long([tok for r in reqs for tok in r.tokens]),
        positions=as_long(positions),
        write_slots=as_long(write),
        q_index=q_index,
        o_index=o_index,
        batch=b,
        max_tokens=t_max,
        output_rows=as_long(out_rows),
        attention=attention,
        meta=attention.prepare(reqs, lay),
    )


@dataclass
class SdpaMeta:
    gather: torch.Tensor  # [B, L] cache slots each request attends over (padding -> slot 0)
    mask: torch.Tensor | None  # [B, 1, G*T, L] True = attend; None = attend to all L slots
    local_mask: torch.Tensor | None = None  # the same for the sliding layers (None = attend to all)


class SdpaAttention(Attention):
    """SDPA over each request's KV slots gathered into a contiguous [B, L] copy every layer.

    Grouped-query attention without repeating K/V: the `H / KVH` query heads sharing a KV head are
    folded into the query-length axis, so SDPA sees KVH heads of `group * T` query rows each (the
    mask is expanded to match in `prepare`).
    """

    name = "sdpa"

    def prepare(self, reqs: list[ForwardRequest], lay: Layout) -> SdpaMeta:
        ps, l_max = lay.page_size, lay.kv_slots
        table = page_table(reqs)
        cols = np.arange(l_max)
        gather = table[:, np.minimum(cols // ps, table.shape[1] - 1)] * ps + cols % ps
        gather[cols[None, :] >= lay.lens[:, None]] = 0  # past a request's end: slot 0, masked out
        need_mask = (lay.static or any(r.mask is not None for r in reqs) or lay.max_tokens > 1
                     or int(lay.lens.min()) != l_max)
        mask_t = local_t = None
        if need_mask:
            mask_t = self._mask(reqs, lay, 0)
        if lay.window > 0 and (need_mask or int(lay.lens.max()) > lay.window):
            local_t = self._mask(reqs, lay, lay.window)
        return SdpaMeta(gather=to_device(gather, lay.device), mask=mask_t, local_mask=local_t)

    @staticmethod
    def _mask(reqs: list[ForwardRequest], lay: Layout, window: int) -> torch.Tensor:
        # rows ordered (query head in group, token), as attend folds them
        m = allowed_mask(reqs, lay, lay.kv_slots, window)
        m = np.repeat(m[:, None], lay.group, axis=1).reshape(lay.batch, 1, lay.group * lay.max_tokens, lay.kv_slots)
        return to_device(m, lay.device)

    def attend(self, q: torch.Tensor, kv: torch.Tensor, plan: BatchPlan, spec: AttnSpec = GLOBAL) -> torch.Tensor:
        meta = cast(SdpaMeta, plan.meta)
        n, h, d = q.shape
        b, t = plan.batch, plan.max_tokens
        kvh = kv.shape[2]
        group = h // kvh
        # index_select on a flat index is far faster on CPU than advanced indexing with a 2-D index
        g = kv.index_select(0, meta.gather.view(-1)).view(b, -1, 2, kvh, d)  # [B, L, 2, KVH, D]
        k = g[:, :, 0].transpose(1, 2)
        v = g[:, :, 1].transpose(1, 2)
        qp = q if plan.q_index is None else q[plan.q_index]
        # [B, T, KVH, G, D] -> [B, KVH, G * T, D]
        qp = qp.view(b, t, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, group * t, d)
        mask = meta.local_mask if spec.local else meta.mask
        if spec.softcap is None:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=spec.scale)
        else:
            o = softcapped_attention(qp, k, v, mask, d ** -0.5 if spec.scale is None else spec.scale, spec.softcap)
        o = o.view(b, kvh, group, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, h * d)
        return o if plan.o_index is None else o[plan.o_index]

    def graph_slots(self, max_len: int) -> int:
        # the gathered KV axis is part of the graph's shapes: powers of two from 64 keep the number
        # of captured graphs per batch bucket logarithmic in the context length
        return max(64, 1 << (max_len - 1).bit_length())


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                         scale: float, cap: float) -> torch.Tensor:
    """Attention with scores soft-capped (cap * tanh(s / cap)) before the mask, softmax in float32, as
    transformers' eager Gemma 2 attention (SDPA has no soft-cap). q: [B, H, Tq, D]; k, v: [B, H, L, D]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / cap) * cap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)
