"""Validation of ForwardRequests at the backend boundary; every error names the request and value."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import fields, replace
from typing import Any

from gpu_backend.types import BackendInfo, ForwardError, ForwardRequest, OutputSpec, SamplerParams

_SAMPLER_FIELDS = {f.name for f in fields(SamplerParams)}


def as_sampler(value: Any, where: str) -> SamplerParams:
    """Accept SamplerParams or a mapping of its fields; reject unknown keys and bad values."""
    if isinstance(value, Mapping):
        unknown = set(value) - _SAMPLER_FIELDS
        if unknown:
            raise ValueError(f"{where}: unknown sampler parameter(s) {sorted(unknown)}; known: {sorted(_SAMPLER_FIELDS)}")
        value = SamplerParams(**value)
    if not isinstance(value, SamplerParams):
        raise ValueError(f"{where}: sampler must be SamplerParams, got {type(value).__name__}")
    t, k, p, mp, seed = value.temperature, value.top_k, value.top_p, value.min_p, value.seed
    if not isinstance(t, int | float) or not math.isfinite(_as_float(t)) or t < 0:
        raise ValueError(f"{where}: temperature must be a finite number >= 0, got {t!r}")
    if not isinstance(k, int) or isinstance(k, bool) or k < 0:
        raise ValueError(f"{where}: top_k must be an int >= 0 (0 = off), got {k!r}")
    if not isinstance(p, int | float) or not 0 < p <= 1:
        raise ValueError(f"{where}: top_p must be in (0, 1], got {p!r}")
    if not isinstance(mp, int | float) or not 0 <= mp <= 1:
        raise ValueError(f"{where}: min_p must be in [0, 1], got {mp!r}")
    # the WIT seed is a u64; the sampler hashes all 64 bits (sampling.seed_uniform)
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
        raise ValueError(f"{where}: seed must be None or an int in [0, 2**64) (a u64), got {seed!r}")
    return value


def _as_float(x: int | float) -> float:
    """float(x), or inf for an int too large for a float (so it is refused, not an OverflowError)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_batch(reqs: Sequence[ForwardRequest], info: BackendInfo) -> list[ForwardRequest]:
    """`check_request` on each request; raises ForwardError carrying the index of the first bad one."""
    checked = []
    for i, r in enumerate(reqs):
        try:
            checked.append(check_request(r, info))
        except ValueError as e:
            raise ForwardError(i, str(e)) from None
    return checked


def check_request(req: ForwardRequest, info: BackendInfo) -> ForwardRequest:
    """Raise ValueError naming `req.name` and the bad value; return the request, samplers normalised
    and marked `checked` (a checked request is returned as is)."""
    if req.checked:
        return req
    page_size, num_pages, vocab_size = info.page_size, info.num_pages, info.vocab_size
    max_position = info.max_position or 2**32
    who = f"forward request {req.name!r}" if req.name else "forward request"
    if not req.tokens:
        raise ValueError(f"{who}: no tokens")
    if not req.pages:
        raise ValueError(f"{who}: no pages")
    for p in req.pages:
        if not _is_int(p) or not 0 <= p < num_pages:
            raise ValueError(f"{who}: page index {p!r} out of range [0, {num_pages})")
    if len(set(req.pages)) != len(req.pages):
        raise ValueError(f"{who}: page list repeats a page: {req.pages}")
    lpl = req.last_page_len
    if not _is_int(lpl) or not 1 <= lpl <= page_size:
        raise ValueError(f"{who}: last_page_len {lpl!r} out of range [1, {page_size}]")
    n = len(req.tokens)
    capacity = req.total_len(page_size)
    if n > capacity:
        raise ValueError(
            f"{who}: {n} new tokens but the pages hold only {capacity} "
            f"({len(req.pages)} pages of {page_size}, last page length {lpl})"
        )
    ctx = capacity - n
    _check_values(req, who, vocab_size, max_position)
    if req.mask is not None:
        _check_mask(req.mask, who, n, ctx)
    if req.embeds is not None:
        _check_embeds(req.embeds, who, n, getattr(info, "hidden_size", 0))
    outputs = []
    for j, o in enumerate(req.outputs):
        if not isinstance(o, OutputSpec):
            raise ValueError(f"{who}: output {j} must be OutputSpec, got {type(o).__name__}")
        if not _is_int(o.index) or not 0 <= o.index < n:
            raise ValueError(f"{who}: output index {o.index!r} out of range [0, {n})")
        if not _is_int(o.dist) or not 0 <= o.dist <= vocab_size:
            raise ValueError(f"{who}: output {j} dist {o.dist!r} out of range [0, {vocab_size}]")
        if o.allowed is not None:
            _check_allowed(o.allowed, f"{who}: output {j}", vocab_size)
        if not isinstance(o.hidden, bool):
            raise ValueError(f"{who}: output {j} hidden must be a bool, got {type(o.hidden).__name__}")
        if o.target is not None and (not _is_int(o.target) or not 0 <= o.target < vocab_size):
            raise ValueError(f"{who}: output {j} target {o.target!r} out of range [0, {vocab_size})")
        sample = None if o.sample is None else as_sampler(o.sample, f"{who}: output {j}")
        outputs.append(o if sample is o.sample else replace(o, sample=sample))
    if outputs != req.outputs:
        req = replace(req, outputs=outputs)
    req.checked = True
    return req


def _check_embeds(embeds: object, who: str, n: int, hidden: int) -> None:
    if not hidden:
        raise ValueError(f"{who}: this backend takes no input embeddings")
    if not isinstance(embeds, list):
        raise ValueError(f"{who}: embeds must be a list of (index, bytes) runs, got {type(embeds).__name__}")
    end = 0
    for k, run in enumerate(sorted(embeds, key=lambda r: r[0] if isinstance(r, tuple) and r else 0)):
        if not (isinstance(run, tuple) and len(run) == 2 and _is_int(run[0]) and isinstance(run[1], bytes)):
            raise ValueError(f"{who}: embeds run {k} must be (index, bytes), got {run!r:.80}")
        start, data = run
        if not data or len(data) % (4 * hidden):
            raise ValueError(f"{who}: embeds run at {start}: {len(data)} bytes is not a whole number of "
                             f"float32 vectors of {hidden}")
        count = len(data) // (4 * hidden)
        if start < end or start + count > n:
            raise ValueError(f"{who}: embeds run at {start} of {count} vectors overlaps another or passes the "
                             f"{n} new tokens")
        end = start + count


def _check_allowed(allowed: object, where: str, vocab_size: int) -> None:
    size = mask_bytes(vocab_size)
    if not isinstance(allowed, bytes):
        raise ValueError(f"{where}: allowed must be bytes (a packed token bitmask), got {type(allowed).__name__}")
    if len(allowed) != size:
        raise ValueError(
            f"{where}: allowed is {len(allowed)} bytes, expected {size} (one bit per token of a "
            f"{vocab_size}-token vocabulary, in int32 words)"
        )


def mask_bytes(vocab_size: int) -> int:
    """Bytes of a packed token bitmask (`OutputSpec.allowed`) over `vocab_size` tokens."""
    return 4 * ((vocab_size + 31) // 32)


def _check_values(req: ForwardRequest, who: str, vocab_size: int, max_position: int) -> None:
    n = len(req.tokens)
    for t in req.tokens:
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{who}: token {t!r} out of range [0, {vocab_size})")
    if len(req.positions) != n:
        raise ValueError(f"{who}: {len(req.positions)} positions for {n} tokens")
    for pos in req.positions:
        if not _is_int(pos) or not 0 <= pos < max_position:
            raise ValueError(f"{who}: position {pos!r} out of range [0, {max_position})")


def _check_mask(mask: list[list[int]], who: str, n: int, ctx: int) -> None:
    if len(mask) != n:
        raise ValueError(f"{who}: {len(mask)} mask rows for {n} tokens")
    for i, row in enumerate(mask):
        if any(not _is_int(r) or r < 0 for r in row):
            raise ValueError(f"{who}: mask row {i} has a negative or non-int run length: {row}")
        if sum(row) != ctx + i + 1:
            raise ValueError(
                f"{who}: mask row {i} covers {sum(row)} tokens, expected {ctx + i + 1} "
                f"(context {ctx} + {i + 1} new)"
            )
        if not any(row[0::2]):
            raise ValueError(f"{who}: mask row {i} attends to no token: {row}")
