"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, seeded draws, top-k distributions.

All sampled rows are filtered together (one sort of the batch's logits). A draw uses one uniform number
per row through the inverse CDF, and a seeded row takes that number from its own generator seeded with
the request's seed, so the token depends only on the seed and the row's distribution, never on the batch.
"""

from __future__ import annotations

import torch

from .types import OutputResult, OutputSpec


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted (descending) probabilities after temperature and filters, and their token ids.

    logits [S, V] float32; temperature/top_p/min_p [S] float, top_k [S] long (0 = off).
    Filtered-out entries are 0; the rest are renormalised.
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_p, ids = probs.sort(dim=-1, descending=True)
    rank = torch.arange(sorted_p.shape[1], device=logits.device)[None, :]
    keep = (top_k[:, None] == 0) | (rank < top_k[:, None])
    # top-p: keep the smallest prefix whose mass reaches top_p (the first token is always kept)
    keep &= (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    keep &= sorted_p >= min_p[:, None] * sorted_p[:, :1]
    sorted_p = torch.where(keep, sorted_p, torch.zeros((), device=logits.device))
    return sorted_p / sorted_p.sum(-1, keepdim=True), ids


def draw(sorted_p: torch.Tensor, ids: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the first sorted entry whose cumulative mass exceeds `uniform` [S]."""
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
        for i, s in enumerate(seeds):
            if s is not None:
                g = torch.Generator(device=self.device)
                g.manual_seed(s)
                u[i] = torch.rand(1, generator=g, device=self.device)[0]
        return u

    def __call__(self, logits: torch.Tensor, specs: list[OutputSpec]) -> list[OutputResult]:
        """logits [M, V] float32, one row per spec (same order)."""
        m = len(specs)
        tokens = torch.zeros(m, dtype=torch.long, device=self.device)
        greedy = [i for i, s in enumerate(specs) if s.sample is not None and s.sample.temperature == 0]
        sampled = [i for i, s in enumerate(specs) if s.sample is not None and s.sample.temperature > 0]
        if greedy:
            rows = torch.tensor(greedy, device=self.device)
            tokens[rows] = logits[rows].argmax(-1)
        if sampled:
            ps = [specs[i].sample for i in sampled]
            rows = torch.tensor(sampled, device=self.device)

            def vec(vals: list[float], dtype: torch.dtype) -> torch.Tensor:
                return torch.tensor(vals, dtype=dtype, device=self.device)

            sp, ids = filtered_probs(
                logits[rows],
                vec([p.temperature for p in ps if p], torch.float32),
                vec([p.top_k for p in ps if p], torch.long),
                vec([p.top_p for p in ps if p], torch.float32),
                vec([p.min_p for p in ps if p], torch.float32),
            )
            tokens[rows] = draw(sp, ids, self._uniforms([p.seed for p in ps if p]))
        k_max = max((s.dist for s in specs), default=0)
        dist_ids = dist_p = None
        if k_max:
            dist_p, dist_ids = torch.softmax(logits, dim=-1).topk(k_max, dim=-1)
        # one device -> host transfer for the whole batch
        tok_list = tokens.tolist()
        di = dist_ids.tolist() if dist_ids is not None else None
        dp = dist_p.tolist() if dist_p is not None else None
        out = []
        for i, s in enumerate(specs):
            res = OutputResult(token=tok_list[i] if s.sample is not None else None)
            if s.dist and di is not None and dp is not None:
                res.ids, res.probs = di[i][: s.dist], dp[i][: s.dist]
            out.append(res)
        return out
