"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, seeded draws, top-k distributions.

All sampled rows are filtered together (one sort of the batch's logits). A draw uses one uniform number
per row through the inverse CDF. A seeded row takes that number from a hash of its seed (all 64 bits
count), so the token depends only on the seed and the row's distribution, never on the batch or device.

Any SamplerParams that `validate.as_sampler` accepts is safe here: the temperature divides the gap to
the row's maximum (<= 0, so a tiny temperature gives -inf, never inf/inf) and is clamped into float32's
normal range; the most probable token survives every filter, so a row's kept mass is > 0; a top-k
past the vocabulary is no filter. A row whose logits are not finite (NaN, +inf, or all -inf) is drawn
from harmlessly and then reported as a SampleError naming the row.

A row with an `allowed` bitmask (`OutputSpec.allowed`, from a grammar matcher) has every other token's
logit set to -inf first, so its draw, its filters and its `dist` see only allowed tokens; a mask that
allows no token is reported as a SampleError for that row. A batch without masks does no mask work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_backend.types import OutputResult, OutputSpec, SamplerParams
from gpu_backend.validate import mask_bytes

__all__ = ["Drawn", "SampleError", "Sampler", "draw", "filtered_probs", "seed_uniform", "unpack_masks"]

_F32 = torch.finfo(torch.float32)
_U64 = (1 << 64) - 1


class SampleError(RuntimeError):
    """Output row `row` of a batch could not be sampled, for `reason` (its logits are not finite)."""

    def __init__(self, row: int, reason: str) -> None:
        super().__init__(f"output row {row}: {reason}")
        self.row, self.reason = row, reason


def unpack_masks(masks: list[bytes], vocab: int, device: torch.device) -> torch.Tensor:
    """Packed token bitmasks (`OutputSpec.allowed`: bit t % 32 of little-endian int32 word t // 32, i.e.
    bit t % 8 of byte t // 8) -> bool [len(masks), vocab], unpacked on `device` (only packed bytes move)."""
    packed = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(len(masks), -1)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (packed.to(device, non_blocking=True).unsqueeze(-1) >> shifts) & 1  # uint8 0/1: a valid bool
    return bits.view(len(masks), -1)[:, :vocab].view(torch.bool)


def seed_uniform(seed: int) -> float:
    """A number in [0, 1) fixed by a u64 seed: splitmix64's finaliser (a bijection on 64 bits), top 24 bits.

    Seeds that differ in any bit give unrelated numbers; 24 bits are exact in float32.
    """
    z = (seed + 0x9E3779B97F4A7C15) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return ((z ^ (z >> 31)) >> 40) / (1 << 24)


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (descending) probabilities after temperature and filters, and their token ids.

    logits [S, V] float32; temperature (> 0)/top_p/min_p [S] float, top_k [S] long (0 = off).
    Filtered-out entries are 0; the rest are renormalised. Every row is finite with its first entry > 0.
    """
    gap = logits - logits.amax(-1, keepdim=True)
    gap = torch.where(gap.isnan(), 0.0, gap)  # a NaN/+inf/all -inf row: uniform here, failed by the caller
    t = temperature.clamp(_F32.tiny, _F32.max)  # float32 rounds tiny temperatures to 0, huge ones to inf
    probs = torch.softmax(gap / t[:, None], dim=-1)
    sorted_p, ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_p.shape[1], device=logits.device)[None, :]
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    # top-p: keep the smallest prefix whose mass reaches top_p
    keep &= (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    keep[:, 0] = True  # the most probable token always survives (top_p can round to 0 in float32)
    sorted_p = torch.where(keep, sorted_p, torch.zeros((), device=logits.device))
    return sorted_p / sorted_p.sum(-1, keepdim=True), ids


def draw(sorted_p: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first sorted entry whose cumulative mass exceeds `uniform` [S].

    Needs sorted_p[:, 0] > 0 (as `filtered_probs` guarantees)."""
    cdf = sorted_p.cumsum(-1)
    idx = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True)
    # never pick a zeroed tail entry (rounding at the top of the CDF)
    nonzero = (sorted_p > 0).sum(-1, keepdim=True) - 1
    idx = torch.minimum(idx, nonzero)
    return ids.gather(1, idx).squeeze(1)


class Sampler:
    """Turns output logits into OutputResults; owns the generator for unseeded draws."""

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def _uniforms(self, seeds: list[int | None]) -> torch.Tensor:
        u = torch.rand(len(seeds), generator=self.generator, device=self.device)
        seeded = [i for i, s in enumerate(seeds) if s is not None]
        if seeded:
            fixed = [seed_uniform(s) for s in seeds if s is not None]
            u[_on(self.device, seeded, torch.long)] = _on(self.device, fixed, torch.float32)
        return u

    def _sample(self, logits: torch.Tensor, params: list[SamplerParams]) -> torch.Tensor:
        """Draw one token per row of logits [S, V] with temperature > 0."""
        vocab = logits.shape[1]

        def vec(vals: list[float] | list[int], dtype: torch.dtype) -> torch.Tensor:
            return _on(self.device, vals, dtype)

        sp, ids = filtered_probs(
            logits,
            vec([float(p.temperature) for p in params], torch.float32),
            vec([min(p.top_k, vocab) for p in params], torch.long),  # past the vocabulary = off, fits int64
            vec([float(p.top_p) for p in params], torch.float32),
            vec([float(p.min_p) for p in params], torch.float32),
        )
        return draw(sp, ids, self._uniforms([p.seed for p in params]))

    def __call__(self, logits: torch.Tensor, specs: list[OutputSpec]) -> list[OutputResult]:
        """logits [M, V] float32, one row per spec (same order). Specs are checked (`validate.as_sampler`).

        Raises SampleError naming the first row whose logits are not finite or whose `allowed` mask allows
        no token; the other rows were fine.
        """
        return self.finish(self.launch(logits, specs))

    def launch(self, logits: torch.Tensor, specs: list[OutputSpec]) -> Drawn:
        """Queue the draws of `__call__` on the device and return at once: the tokens and checks are
        copied to host memory behind the batch (on CUDA, pinned memory and an event; no host sync).
        `finish` reads them."""
        m, vocab = logits.shape
        dev = self.device
        scored = _scored(logits, specs)  # before the masks: a target's logprob is the model's own
        allowed = None
        if any(s.allowed is not None for s in specs):  # a batch without masks skips this
            everything = b"\xff" * mask_bytes(vocab)  # rows without a mask keep their logits exactly
            allowed = unpack_masks([everything if s.allowed is None else s.allowed for s in specs], vocab, dev)
            logits = torch.where(allowed, logits, -torch.inf)
        greedy = [i for i, s in enumerate(specs) if s.sample is not None and s.sample.temperature == 0]
        sampled = [(i, s.sample) for i, s in enumerate(specs) if s.sample is not None and s.sample.temperature > 0]
        if len(greedy) == m:  # the common batch: every row greedy, no index work
            tokens = logits.argmax(-1)
        else:
            tokens = torch.zeros(m, dtype=torch.long, device=dev)
            if greedy:
                rows = _on(dev, greedy, torch.long)
                tokens[rows] = logits[rows].argmax(-1)
            if sampled:
                rows = _on(dev, [i for i, _ in sampled], torch.long)
                tokens[rows] = self._sample(logits[rows], [p for _, p in sampled])
        k_max = min(max((s.dist for s in specs), default=0), vocab)
        dist_ids = dist_p = None
        bad = (~torch.isfinite(logits.amax(-1))).long()  # 1: NaN, +inf, or every token at -inf
        if allowed is not None:
            bad = torch.where(allowed.any(-1), bad, 2)  # 2: the row's mask allows no token
        checks = [tokens, bad]
        if k_max:
            probs = torch.softmax(logits, dim=-1)
            dist_p, dist_ids = probs.topk(k_max, dim=-1)
            masked = [i for i, s in enumerate(specs) if s.allowed is not None and s.dist]
            if allowed is not None and masked:  # rank by logit: allowed (finite) before disallowed (-inf)
                rows = _on(dev, masked, torch.long)
                ids = logits[rows].topk(k_max, dim=-1).indices
                dist_ids[rows], dist_p[rows] = ids, probs[rows].gather(1, ids)
                checks.append(allowed.sum(-1))  # each row's dist stops at its allowed tokens
        # one device -> host transfer for the tokens and the checks (and one for a distribution)
        return Drawn(specs, _to_host(torch.stack(checks)), None if dist_ids is None else _to_host(dist_ids),
                     None if dist_p is None else _to_host(dist_p), _event(dev), tokens,
                     None if scored is None else _to_host(scored))

    def finish(self, drawn: Drawn) -> list[OutputResult]:
        """The OutputResults of a launched draw (waits for its copies; see `__call__` for errors)."""
        if drawn.event is not None:
            drawn.event.synchronize()
        specs = drawn.specs
        host = drawn.checks.tolist()
        tok_list, bad_list = host[0], host[1]
        if any(bad_list):
            row = next(i for i, b in enumerate(bad_list) if b)
            if bad_list[row] == 2:
                raise SampleError(row, "its allowed-token mask allows no token (the grammar admits none here)")
            raise SampleError(row, "logits are not finite (NaN, +inf, or -inf for every token)")
        di = drawn.dist_ids.tolist() if drawn.dist_ids is not None else None
        dp = drawn.dist_p.tolist() if drawn.dist_p is not None else None
        lp = drawn.scored.tolist() if drawn.scored is not None else None
        out = []
        for i, s in enumerate(specs):
            res = OutputResult(token=tok_list[i] if s.sample is not None else None)
            if s.dist and di is not None and dp is not None:
                k = s.dist if s.allowed is None else min(s.dist, host[2][i])
                res.ids, res.probs = di[i][:k], dp[i][:k]
            if s.target is not None and lp is not None:
                res.logprob = lp[i]
            if s.hidden and drawn.hidden is not None:
                res.hidden = drawn.hidden[i].numpy().astype("<f4").tobytes()
            out.append(res)
        return out


@dataclass
class Drawn:
    """A launched draw (`Sampler.launch`): host copies of its results, valid once `event` has passed."""

    specs: list[OutputSpec]
    checks: torch.Tensor  # [2 or 3, M] int64: tokens, bad-row codes, allowed counts
    dist_ids: torch.Tensor | None
    dist_p: torch.Tensor | None
    event: torch.cuda.Event | None  # None on CPU: the copies are done
    tokens: torch.Tensor | None = None  # [M] the drawn tokens on the device (a next step may read them there)
    scored: torch.Tensor | None = None  # [M] float32: each row's target's logprob (0 for rows without one)
    hidden: torch.Tensor | None = None  # [M, hidden] float32 on the host, when a row asked for its hidden state


def _scored(logits: torch.Tensor, specs: list[OutputSpec]) -> torch.Tensor | None:
    """[M] float32 on the device: the log-softmax of each row's `target` (rows without one: 0), or None
    when no row has a target (the common batch: no work)."""
    if all(s.target is None for s in specs):
        return None
    targets = _on(logits.device, [0 if s.target is None else s.target for s in specs], torch.long)
    return torch.log_softmax(logits.float(), dim=-1).gather(1, targets[:, None])[:, 0]


def _on(device: torch.device, values: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
    """A small host list on `device` without a host sync (a CPU tensor copied asynchronously)."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """`t` on the host: on CUDA, a pinned buffer filled asynchronously (read it after the event)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def _event(device: torch.device) -> torch.cuda.Event | None:
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record()
    return ev
