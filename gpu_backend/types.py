"""The batch format shared by the host and the backend.

Plain dataclasses of ints/floats/lists so a batch can later cross a socket to a remote
backend process. Validation of these values happens in `Backend.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplerParams:
    """How to draw one token. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    min_p: float = 0.0  # 0 = no min-p filter
    seed: int | None = None  # same seed + same distribution -> same token, whatever the batch


@dataclass(frozen=True)
class OutputSpec:
    """One output row of a request: `index` is a position in the request's new tokens."""

    index: int
    sample: SamplerParams | None = None
    dist: int = 0  # return the `dist` most probable (id, prob) pairs; 0 = none


@dataclass
class ForwardRequest:
    """Append `tokens` to the sequence held in `pages` and compute the requested outputs.

    pages: all pages of the sequence, new tokens included, in order.
    last_page_len: valid slots in the last page *after* this pass (1..page_size).
        Context before the pass = (len(pages)-1)*page_size + last_page_len - len(tokens);
        the new tokens' K/V are written at the slots right after it.
    positions: one RoPE position per new token.
    mask: None (causal) or one BRLE row per new token: run lengths alternating attend /
        masked starting with attend; row i covers context + tokens[0..=i] (its run lengths
        sum to context_len + i + 1).
    """

    pages: list[int]
    last_page_len: int
    tokens: list[int]
    positions: list[int]
    mask: list[list[int]] | None = None
    outputs: list[OutputSpec] = field(default_factory=list)
    name: str = ""  # who asked (instance id), used in error messages


@dataclass
class OutputResult:
    """Answer for one OutputSpec, same order as the request's outputs."""

    token: int | None = None
    ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


class ForwardError(ValueError):
    """A request in a batch is invalid; the message names the request and the bad value."""

    def __init__(self, request_index: int, message: str) -> None:
        super().__init__(message)
        self.request_index = request_index
