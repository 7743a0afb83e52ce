"""Logits parity with transformers: the check shared by the CPU, HF-directory and CUDA tests."""

from __future__ import annotations

import math

import torch

from gpu_backend import ForwardRequest, OutputSpec

PROMPTS = [
    "What is the capital of France?",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived",
]
DECODE_STEPS = 32
# Both sides run in float32 on identical dequantized weights; they differ only in summation order
# (fused qkv / gate-up matmuls, SDPA vs eager attention), which moves logits (magnitude ~10-30) by
# ~1e-4 after 30 layers. 1e-2 leaves a wide margin yet catches any real defect (a wrong RoPE
# position or mask moves logits by whole units).
LOGIT_TOL = 1e-2


def _pages_for(start_page: int, total: int, page_size: int) -> list[int]:
    return list(range(start_page, start_page + math.ceil(total / page_size)))


def run_parity(backend, hf_model, prompts: list[str], steps: int, tol: float, min_top1: float = 1.0) -> float:
    """Decode `steps` greedy tokens per prompt through pages (all prompts in one ragged batch per
    pass), then check every step's logits against one transformers pass over the whole sequence.
    Top-1 equal at every position means transformers' greedy decode yields the same tokens.
    `min_top1` < 1 allows a fraction of top-1 disagreements (bfloat16 near-ties)."""
    tok = backend.tokenizer
    ps = backend.info.page_size
    ids = [tok.encode(p) for p in prompts]
    lens = [len(s) for s in ids]
    pages, nxt = [], 0
    for n in lens:
        pages.append(_pages_for(nxt, n + steps, ps))
        nxt += len(pages[-1])
    seqs = [list(s) for s in ids]
    ours: list[list[torch.Tensor]] = [[] for _ in ids]
    new = [list(s) for s in ids]
    for _ in range(steps + 1):
        reqs = []
        for i, seq_new in enumerate(new):
            total = len(seqs[i])
            used = math.ceil(total / ps)
            reqs.append(ForwardRequest(
                pages=pages[i][:used], last_page_len=total - (used - 1) * ps, tokens=seq_new,
                positions=list(range(total - len(seq_new), total)),
                outputs=[OutputSpec(index=len(seq_new) - 1)],
            ))
        for i, lg in enumerate(backend.logits(reqs)):
            ours[i].append(lg[0].float().cpu())
            seqs[i].append(int(lg[0].argmax()))
        new = [[s[-1]] for s in seqs]
    worst, agree, total = 0.0, 0, 0
    with torch.inference_mode():
        for i, seq in enumerate(seqs):
            ref = hf_model(torch.tensor([seq[:-1]], device=hf_model.device)).logits[0].float().cpu()
            for step, lg in enumerate(ours[i]):
                r = ref[lens[i] - 1 + step]
                diff = (lg - r).abs().max().item()
                worst = max(worst, diff)
                assert diff < tol, f"prompt {i} step {step}: max |logit diff| {diff}"
                same = lg.argmax().item() == r.argmax().item()
                assert same or min_top1 < 1, f"prompt {i} step {step}: top-1 differs"
                agree, total = agree + same, total + 1
    assert agree >= min_top1 * total, f"top-1 agreed at {agree}/{total} steps"
    return worst
