"""The plain generation loop of a backend (`TorchBackend.generate_batch`): prefill every prompt in
one pass, then decode them in lock step, one batched forward per step, each step launched before
the host reads the token of the one before (`Feed`). A baseline for benchmarks and a demo; the host
runs its own loops (host/batching/generation.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from gpu_backend.models.config import ModelInfo
from gpu_backend.types import Feed, ForwardRequest, OutputSpec, SamplerParams, StartedForward
from gpu_backend.validate import as_sampler

__all__ = ["generate_batch"]

GREEDY = SamplerParams()  # frozen, safe as a default


class Stepping(Protocol):
    """What the loop drives: a backend with `start_forward` (`TorchBackend`)."""

    feeds: bool

    @property
    def info(self) -> ModelInfo: ...

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> StartedForward: ...


def generate_batch(backend: Stepping, prompts: list[list[int]], max_tokens: int, sampler: SamplerParams = GREEDY,
                   stop_tokens: list[int] | None = None, pages: list[list[int]] | None = None) -> list[list[int]]:
    """Prefill all prompts in one pass, then decode them in lock step, one batched forward per step.

    `pages[i]` are the pages sequence i may use (enough for prompt + max_tokens). If `pages` is None,
    sequences take consecutive pages from page 0 up: only for callers that own the whole cache
    (demos, benchmarks), as those pages are overwritten. `stop_tokens` None = the model's stop
    tokens; a drawn stop token ends that sequence and is included in its output.
    """
    sampler = as_sampler(sampler, "generate")
    stops = set(backend.info.stop_tokens if stop_tokens is None else stop_tokens)
    ps = backend.info.page_size
    need = [math.ceil((len(p) + max_tokens) / ps) for p in prompts]
    if pages is None:
        if sum(need) > backend.info.num_pages:
            raise ValueError(f"generate: needs {sum(need)} pages, the cache has {backend.info.num_pages}")
        starts = np.concatenate([[0], np.cumsum(need)]).tolist()
        pages = [list(range(starts[i], starts[i] + need[i])) for i in range(len(prompts))]
    for i, (p, nd) in enumerate(zip(pages, need, strict=True)):
        if len(p) < nd:
            raise ValueError(f"generate: sequence {i} needs {nd} pages, got {len(p)}")
    longest = max((len(p) for p in prompts), default=0) + max_tokens
    if backend.info.max_position and longest > backend.info.max_position:
        raise ValueError(f"generate: {longest} positions, the model has {backend.info.max_position}")
    outs: list[list[int]] = [[] for _ in prompts]
    if max_tokens <= 0:
        return outs
    # The first pass (prefill) validates; each decode step after it is launched before the host
    # reads the token the step before draws (`Feed`: read on the device), so the device runs step
    # after step while the host reads them one behind. A sequence that draws a stop token has had
    # its next step launched already: that step's slot is past its end (within its pages) and its
    # token is dropped. A backend that cannot feed (`feeds` False) waits for each step first.
    step = backend.start_forward([ForwardRequest(
        pages=pages[i][: -(-len(p) // ps)], last_page_len=len(p) - (-(-len(p) // ps) - 1) * ps, tokens=list(p),
        positions=list(range(len(p))), outputs=[OutputSpec(index=len(p) - 1, sample=sampler)],
        name=f"generate[{i}]") for i, p in enumerate(prompts)])
    spec = [OutputSpec(index=0, sample=sampler)]
    pos = [len(p) for p in prompts]  # where each sequence's next token goes
    rows = list(range(len(prompts)))  # the sequences of `step`, in order
    done: set[int] = set()

    def launch(seqs: list[int], src: StartedForward, known: list[int] | None) -> StartedForward:
        reqs = []
        for k, i in enumerate(seqs):
            total = pos[i] + 1
            used = (total + ps - 1) // ps
            reqs.append(ForwardRequest(pages=pages[i][:used], last_page_len=total - (used - 1) * ps,
                                       tokens=[0 if known is None else known[k]], positions=[pos[i]],
                                       outputs=spec, name=f"generate[{i}]", checked=True))
            pos[i] = total
        if known is not None:
            return backend.start_forward(reqs)
        where = {i: k for k, i in enumerate(rows)}
        return backend.start_forward(reqs, Feed(src, range(len(seqs)), [where[i] for i in seqs]))

    while True:
        # launched now: every sequence that has room for a token after the one `step` draws
        cont = [i for i in rows if i not in done and len(outs[i]) + 1 < max_tokens]
        nxt = launch(cont, step, None) if cont and backend.feeds else None
        res = step.wait()
        for k, i in enumerate(rows):
            if i in done:
                continue
            tok = res[k][0].token
            assert tok is not None  # every request asked for a sampled token
            outs[i].append(tok)
            if tok in stops or len(outs[i]) >= max_tokens:
                done.add(i)
        if nxt is None and cont and not backend.feeds:
            cont = [i for i in cont if i not in done]
            nxt = launch(cont, step, [outs[i][-1] for i in cont]) if cont else None
        if nxt is None:
            return outs
        step, rows = nxt, cont
