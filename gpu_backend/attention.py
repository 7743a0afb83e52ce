"""Batch plan (gather indices, masks) built once per forward, and the attention it drives.

All requests of a batch are laid out as a padded [B, T] grid of queries against a padded [B, L] grid
of KV slots gathered from the pages; one SDPA call per layer then serves the whole ragged batch, with
the per-token masks (causal or BRLE) folded into one boolean mask built once and reused by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from .types import ForwardRequest


@dataclass
class BatchPlan:
    tokens: torch.Tensor  # [N] new tokens of all requests, concatenated
    positions: torch.Tensor  # [N]
    write_slots: torch.Tensor  # [N] cache slot of each new token
    gather: torch.Tensor  # [B, L] cache slots each request attends over (padding -> slot 0)
    mask: torch.Tensor | None  # [B, 1, G*T, L] True = attend; None = attend to all L slots
    q_index: torch.Tensor | None  # [B*T] token row for each padded query row; None if no padding
    o_index: torch.Tensor | None  # [N] padded query row of each token; None if no padding
    batch: int
    max_tokens: int
    output_rows: torch.Tensor  # [M] token rows whose logits are wanted


def brle_row(runs: list[int]) -> np.ndarray:
    """Expand BRLE run lengths (attend, masked, attend, ...) into a boolean row."""
    flags = np.zeros(len(runs), dtype=bool)
    flags[0::2] = True
    return np.repeat(flags, runs)


def build_plan(reqs: list[ForwardRequest], page_size: int, device: torch.device, group: int = 1) -> BatchPlan:
    """Index tensors and the mask for a batch of validated requests.

    `group` = query heads per KV head: mask rows are repeated to match paged_attention's layout.
    """
    n_tok = [len(r.tokens) for r in reqs]
    ctx = [r.context_len(page_size) for r in reqs]
    lens = [c + t for c, t in zip(ctx, n_tok, strict=True)]
    b, t_max, l_max = len(reqs), max(n_tok), max(lens)

    gather = np.zeros((b, l_max), dtype=np.int64)
    write = np.empty(sum(n_tok), dtype=np.int64)
    start = 0
    for i, r in enumerate(reqs):
        slots = (np.asarray(r.pages, dtype=np.int64)[:, None] * page_size + np.arange(page_size)).ravel()
        gather[i, : lens[i]] = slots[: lens[i]]
        write[start : start + n_tok[i]] = slots[ctx[i] : lens[i]]
        start += n_tok[i]

    mask_t = _mask(reqs, ctx, n_tok, lens, group, device)

    q_index = o_index = None
    if min(n_tok) != t_max:
        starts = np.concatenate([[0], np.cumsum(n_tok)[:-1]])
        grid = np.arange(t_max)[None, :]
        q_index = torch.from_numpy((starts[:, None] + np.minimum(grid, np.asarray(n_tok)[:, None] - 1)).ravel())
        o_index = torch.from_numpy(
            np.concatenate([i * t_max + np.arange(n) for i, n in enumerate(n_tok)])
        )
        q_index, o_index = q_index.to(device), o_index.to(device)

    out_rows: list[int] = []
    start = 0
    for r, n in zip(reqs, n_tok, strict=True):
        out_rows.extend(start + o.index for o in r.outputs)
        start += n

    def as_long(x: list[int] | np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(x, dtype=np.int64)).to(device)

    return BatchPlan(
        tokens=as_long([tok for r in reqs for tok in r.tokens]),
        positions=as_long([p for r in reqs for p in r.positions]),
        write_slots=as_long(write),
        gather=as_long(gather),
        mask=mask_t,
        q_index=q_index,
        o_index=o_index,
        batch=b,
        max_tokens=t_max,
        output_rows=as_long(out_rows),
    )


def paged_attention(q: torch.Tensor, kv: torch.Tensor, plan: BatchPlan) -> torch.Tensor:
    """q: [N, H, D]; kv: one layer of the cache [slots, 2, KVH, D] (new tokens already written).

    Returns [N, H * D]. Grouped-query attention without repeating K/V: the `H / KVH` query heads
    sharing a KV head are folded into the query-length axis, so SDPA sees KVH heads of
    `group * T` query rows each (the mask was expanded to match when the plan was built).
    """
    n, h, d = q.shape
    b, t = plan.batch, plan.max_tokens
    kvh = kv.shape[2]
    group = h // kvh
    # index_select on a flat index is far faster on CPU than advanced indexing with a 2-D index
    g = kv.index_select(0, plan.gather.view(-1)).view(b, -1, 2, kvh, d)  # [B, L, 2, KVH, D]
    k = g[:, :, 0].transpose(1, 2)
    v = g[:, :, 1].transpose(1, 2)
    qp = q if plan.q_index is None else q[plan.q_index]
    # [B, T, KVH, G, D] -> [B, KVH, G * T, D]
    qp = qp.view(b, t, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, group * t, d)
    o = F.scaled_dot_product_attention(qp, k, v, attn_mask=plan.mask)
    o = o.view(b, kvh, group, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, h * d)
    return o if plan.o_index is None else o[plan.o_index]


def _mask(reqs: list[ForwardRequest], ctx: list[int], n_tok: list[int], lens: list[int], group: int,
          device: torch.device) -> torch.Tensor | None:
    """The [batch, 1, group * t_max, l_max] attention mask, or None when plain causal decode needs none."""
    b, t_max, l_max = len(reqs), max(n_tok), max(lens)
    if not (any(r.mask is not None for r in reqs) or t_max > 1 or min(lens) != l_max):
        return None
    rows = np.arange(t_max)[None, :, None]
    cols = np.arange(l_max)[None, None, :]
    c = np.asarray(ctx)[:, None, None]
    t = np.asarray(n_tok)[:, None, None]
    # causal: row t sees slots up to ctx + t; padding rows (t >= n_tok) see slot 0 only (no NaN).
    mask = np.where(rows < t, cols <= c + rows, cols == 0)
    for i, r in enumerate(reqs):
        if r.mask is not None:
            for row, runs in enumerate(r.mask):
                mask[i, row, : ctx[i] + row + 1] = brle_row(runs)
    # rows ordered (query head in group, token), as paged_attention folds them
    mask = np.repeat(mask[:, None], group, axis=1).reshape(b, 1, group * t_max, l_max)
    return torch.from_numpy(mask).to(device)
