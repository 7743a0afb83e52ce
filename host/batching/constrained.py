"""Grammar-constrained host-side generation loops (WIT `forward.generate-constrained`).

A `ConstrainedGeneration` is a `Generation` whose every step draws from the tokens a grammar
matcher allows: the drawn token is accepted by the matcher, then the next step's mask is filled,
all on the scheduler thread between two backend calls (no guest wake-up per token). A loop without
a matcher is a plain `Generation` and pays nothing for this module.

Invariants: the request's one output always carries the current matcher's mask; the model's stop
tokens end the loop (a stop token is drawn only where the grammar may end, and terminates the
matcher); a step at which the grammar admits no token ends the loop with finish `grammar-error`
and `error` saying why.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from gpu_backend.grammar import Matcher, mask_words
from host.batching.generation import Generation, GenerationResult, StopRules

__all__ = ["ConstrainedGeneration", "GRAMMAR_ERROR", "allowed_mask"]

GRAMMAR_ERROR = "grammar-error"  # the finish of a loop the grammar left without a token to draw


def allowed_mask(matcher: Matcher) -> bytes | str:
    """The packed mask of the tokens `matcher` allows next, or why it allows none."""
    if matcher.is_terminated():
        return "the matcher is terminated (its grammar's output is complete): it allows no more tokens"
    mask = matcher.fill_mask(np.empty(mask_words(matcher.grammar.vocab_size), dtype=np.int32))
    if not mask.any():
        return matcher.error or "the grammar admits no token of the vocabulary here"
    return mask.tobytes()


class ConstrainedGeneration(Generation):
    """A host-side loop whose draws `matcher` constrains; `accepted` counts the tokens it fed the matcher."""

    FAST_STEPS = False  # each token goes through the matcher
    AHEAD = False  # the next step's mask needs the token

    def __init__(self, *args: Any, matcher: Matcher, first_mask: bytes, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.matcher = matcher
        self.accepted = 0
        self.error: str | None = None
        stops = self.rules.stop_tokens | matcher.grammar.stop_tokens
        self.rules = StopRules(self.rules.max_tokens, stops, self.rules.stop_strings, self.rules.max_position)
        self.stop_tokens = stops
        self._mask(first_mask)

    def advance(self, token: int) -> bool:
        """Accept `token` into the matcher, then as `Generation.advance`, then mask the next step."""
        if self.cancelled:
            return super().advance(token)
        if not self.matcher.accept(token):  # the mask allowed it: a refusal is a library fault
            return self._fail(f"the grammar refused the drawn token {token}")
        self.accepted += 1
        if super().advance(token):
            return True
        got = allowed_mask(self.matcher)
        if isinstance(got, str):
            return self._fail(got)
        self._mask(got)
        return False

    def _mask(self, allowed: bytes) -> None:
        req = self.request
        req.outputs = [replace(req.outputs[0], allowed=allowed)]

    def _fail(self, reason: str) -> bool:
        self.error = f"{reason} (after {len(self.tokens)} generated tokens)"
        self.result = GenerationResult(self.tokens, self.new_pages, 0, GRAMMAR_ERROR)
        return True
