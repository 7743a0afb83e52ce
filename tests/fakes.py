"""Fakes for fast host tests: the stand-in backend (`gpu_backend.types.Backend`, no model) plus
failure injection.

The stand-in's "model" is deterministic: the sampled token after token t is (t + 1) % vocab, so
an inferlet's output is predictable and any cross-talk between instances shows up.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpu_backend.standin import StandInBackend, StandInStep
from gpu_backend.types import Feed, ForwardRequest

__all__ = ["FakeBackend"]


class FakeBackend(StandInBackend):
    """The stand-in backend; `fail_next = True` makes its next batch raise (a backend crash)."""

    def __init__(self, page_size: int = 4, num_pages: int = 64, delay_s: float = 0.0) -> None:
        super().__init__(page_size=page_size, num_pages=num_pages, delay_s=delay_s)
        self.fail_next = False

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> StandInStep:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected backend failure")
        return super().start_forward(reqs, feed)
