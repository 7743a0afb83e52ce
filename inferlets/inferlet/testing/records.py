"""The fake host's WIT records (same shapes as componentize-py's bindings) and `FakeTrap`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["FakeTrap", "Request", "WitMessage", "WitOutput", "WitOutputSpec", "WitSampler", "trap"]


class FakeTrap(Exception):
    """The real host would trap the instance here."""


def trap(call: str, why: str) -> FakeTrap:
    """A trap of the WIT call `call` (e.g. "kv.release"), saying why."""
    return FakeTrap(f"{call}: {why}")


@dataclass
class WitSampler:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None


@dataclass
class WitOutputSpec:
    index: int
    sample: WitSampler | None
    dist: int


@dataclass
class WitOutput:
    token: int | None
    ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


@dataclass
class WitGeneration:
    """The WIT `generation` record (`finish` as its kebab-case name)."""

    tokens: list[int]
    new_pages: list[int]
    trim: int
    finish: str


@dataclass
class WitMessage:
    role: str
    content: str


@dataclass
class Request:
    """One recorded forward pass, as the guest made it (mask [] = causal)."""

    pages: list[int]
    last_page_len: int
    tokens: list[int]
    positions: list[int]
    mask: list[list[int]]
    outputs: list[WitOutputSpec]
