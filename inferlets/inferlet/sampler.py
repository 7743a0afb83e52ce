"""Sampling parameters and stop conditions for `Context.generate`."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from inferlet import _host

__all__ = ["Sampler", "Stop", "MaxTokens", "UntilTokens", "UntilSequence", "UntilText", "AnyOf"]

_U64 = 1 << 64


@dataclass(frozen=True)
class Sampler:
    """How the host draws a token. temperature 0 is greedy; top_k 0, top_p 1, min_p 0 disable filters.

    With a seed, `generate` uses seed + step for step `step`, so a run is reproducible.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    _wit: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
            raise ValueError(
                f"invalid sampler {self!r}: need temperature>=0, top_k>=0, 0<top_p<=1, 0<=min_p<=1"
            )

    @staticmethod
    def greedy() -> Sampler:
        """Always the most probable token."""
        return GREEDY

    def with_seed(self, seed: int | None) -> Sampler:
        """The same parameters with another seed."""
        return Sampler(self.temperature, self.top_k, self.top_p, self.min_p, seed)

    def to_wit(self) -> object:
        """The WIT `sampler` record (built once per Sampler: a decode step reuses it)."""
        if self._wit is None:
            rec = _host.forward.Sampler(
                temperature=float(self.temperature),
                top_k=int(self.top_k),
                top_p=float(self.top_p),
                min_p=float(self.min_p),
                seed=None if self.seed is None else int(self.seed) % _U64,
            )
            object.__setattr__(self, "_wit", rec)
        return self._wit


GREEDY = Sampler()


class Stop(Protocol):
    """A stop condition, asked after every generated token.

    `check` gets all tokens generated so far and a decoder for token lists. It returns None to go
    on, or the number of trailing tokens to leave out of the returned text (0 keeps them all).
    """

    def check(self, generated: Sequence[int], decode: _Decode) -> int | None: ...


class _Decode(Protocol):
    def __call__(self, tokens: Sequence[int]) -> str: ...


@dataclass(frozen=True)
class MaxTokens:
    """Stop after `n` tokens."""

    n: int

    def check(self, generated: Sequence[int], decode: _Decode) -> int | None:
        return 0 if len(generated) >= self.n else None


@dataclass(frozen=True)
class UntilTokens:
    """Stop at any of `tokens` (e.g. the model's stop tokens); the stop token is not in the text."""

    tokens: frozenset[int]

    def __init__(self, tokens: Iterable[int]) -> None:
        object.__setattr__(self, "tokens", frozenset(tokens))

    def check(self, generated: Sequence[int], decode: _Decode) -> int | None:
        return 1 if generated and generated[-1] in self.tokens else None


@dataclass(frozen=True)
class UntilSequence:
    """Stop when the generated tokens end with `tokens`; the sequence is not in the text."""

    tokens: tuple[int, ...]

    def __init__(self, tokens: Iterable[int]) -> None:
        object.__setattr__(self, "tokens", tuple(tokens))
        if not self.tokens:
            raise ValueError("UntilSequence needs at least one token")

    def check(self, generated: Sequence[int], decode: _Decode) -> int | None:
        n = len(self.tokens)
        return n if tuple(generated[-n:]) == self.tokens else None


@dataclass(frozen=True)
class UntilText:
    """Stop once the generated text contains `text` (it stays in the text; the caller may cut it).

    Only a tail of the tokens is decoded (every token is at least one byte), so the cost per
    step does not grow with the output.
    """

    text: str

    def check(self, generated: Sequence[int], decode: _Decode) -> int | None:
        if not self.text:
            raise ValueError("UntilText needs a non-empty text")
        window = len(self.text.encode()) + 4  # + a partial UTF-8 character at the window's start
        return 0 if self.text in decode(generated[-window:]) else None


@dataclass(frozen=True)
class AnyOf:
    """Stop when any of the conditions does (the first one that fires decides the trimming)."""

    conditions: tuple[Stop, ...]

    def __init__(self, *conditions: Stop) -> None:
        object.__setattr__(self, "conditions", conditions)

    def check(self, generated: Sequence[int], decode: _Decode) -> int | None:
        for c in self.conditions:
            trim = c.check(generated, decode)
            if trim is not None:
                return trim
        return None
