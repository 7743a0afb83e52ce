"""Fakes for fast host tests: the stand-in backend (`gpu_backend.types.Backend`, no model) plus
failure injection.

The stand-in's "model" is deterministic: the sampled token after token t is (t + 1) % vocab, so
an inferlet's output is predictable and any cross-talk between instances shows up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from gpu_backend.standin import StandInBackend, StandInStep
from gpu_backend.types import Feed, ForwardRequest

__all__ = ["FakeBackend"]


class FakeBackend(StandInBackend):
    """The stand-in backend; `fail_next = True` makes its next batch raise (a backend crash).

    `reads=True`: a sampled token also depends on everything the request attends to (the sum of
    the tokens stored in its pages up to the output's slot; a slot never written counts -1000), as a
    model's does, so a page whose K/V was lost or mixed up (by a swap, a copy, a wrong page id)
    changes the output."""

    def __init__(self, page_size: int = 4, num_pages: int = 64, delay_s: float = 0.0, reads: bool = False) -> None:
        super().__init__(page_size=page_size, num_pages=num_pages, delay_s=delay_s)
        self.fail_next = False
        self.reads = reads

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> StandInStep:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected backend failure")
        step = super().start_forward(reqs, feed)
        if self.reads:
            ps, vocab = self.info.page_size, self.info.vocab_size
            with self._lock:
                for r, res in zip(reqs, step.outputs, strict=True):
                    ctx = r.context_len(ps)
                    for k, (o, out) in enumerate(zip(r.outputs, res, strict=True)):
                        if out.token is None:
                            continue
                        seen = sum(self.slots.get((r.pages[s // ps], s % ps), -1000) for s in range(ctx + o.index + 1))
                        res[k] = replace(out, token=(out.token + seen) % vocab)
        return step
