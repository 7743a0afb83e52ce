"""Fake of the WIT interface `grammar` and of the constrained `forward` calls, over `TinyBackend`.

Grammars compile with `gpu_backend.grammar` against the toy vocabulary (id = byte + 3, specials never
text). The toy model ignores token masks, so a constrained draw here takes the model's token when the
grammar allows it, else the next allowed id (cyclically): deterministic, and always in the grammar.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from inferlet import _host
from inferlet.testing.records import trap
from inferlet.testing.tiny import SPECIALS, VOCAB, TinyInfo

from gpu_backend.grammar import Grammar, GrammarCompiler, Matcher, mask_words

__all__ = ["FakeGrammarInterface", "FakeMatcher", "allowed_or_err", "constrain"]


def _compiler(info: TinyInfo) -> GrammarCompiler:
    tokens = [s.encode() for s in SPECIALS] + [bytes([b]) for b in range(VOCAB - len(SPECIALS))]
    return GrammarCompiler.from_token_bytes(tokens, info, special=range(len(SPECIALS)))


class FakeMatcher:
    """The `matcher` resource: a `gpu_backend.grammar.Matcher` behind the WIT method names."""

    def __init__(self, m: Matcher) -> None:
        self.m = m

    def accept(self, tokens: list[int]) -> int:
        n = 0
        for t in tokens:
            if not self.m.accept(t):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        if n > self.m.accepted:
            raise trap("grammar.[method]matcher.rollback", f"rollback of {n}, only {self.m.accepted} accepted")
        self.m.rollback(n)

    def accepted(self) -> int:
        return self.m.accepted

    def is_terminated(self) -> bool:
        return self.m.is_terminated()

    def reset(self) -> None:
        self.m.reset()

    def fork(self) -> FakeMatcher:
        return FakeMatcher(self.m.fork())


class FakeGrammarInterface:
    """`grammar` with its two resources; `Grammar.from_*` raise `_host.Err` with the compiler's reason."""

    Matcher = FakeMatcher

    def __init__(self, info: TinyInfo) -> None:
        compiler = _compiler(info)

        class FakeGrammar:
            def __init__(self, g: Grammar) -> None:
                self.g = g

            @classmethod
            def _make(cls, build: Any, *args: str) -> FakeGrammar:
                try:
                    return cls(build(*args))
                except ValueError as e:
                    raise _host.Err(str(e)) from None

            @classmethod
            def from_json_schema(cls, schema: str) -> FakeGrammar:
                return cls._make(compiler.json_schema, schema)

            @classmethod
            def from_regex(cls, pattern: str) -> FakeGrammar:
                return cls._make(compiler.regex, pattern)

            @classmethod
            def from_ebnf(cls, text: str) -> FakeGrammar:
                return cls._make(compiler.ebnf, text)

            @classmethod
            def from_lark(cls, text: str) -> FakeGrammar:
                return cls._make(compiler.lark, text)

            @classmethod
            def any_json(cls) -> FakeGrammar:
                return cls._make(compiler.any_json)

            def matcher(self) -> FakeMatcher:
                return FakeMatcher(Matcher(self.g))

        self.Grammar = FakeGrammar


def allowed_or_err(m: FakeMatcher) -> np.ndarray:
    """The matcher's mask as a bool array over the vocabulary; `_host.Err` when it allows nothing."""
    if m.m.is_terminated():
        raise _host.Err("the matcher is terminated (its grammar's output is complete)")
    words = m.m.fill_mask(np.empty(mask_words(m.m.grammar.vocab_size), dtype=np.int32))
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[: m.m.grammar.vocab_size].astype(bool)
    if not bits.any():
        raise _host.Err(m.m.error or "the grammar admits no token here")
    return bits


def constrain(token: int, allowed: np.ndarray) -> int:
    """The model's token if allowed, else the next allowed id (cyclically)."""
    if allowed[token]:
        return token
    later = np.flatnonzero(allowed[token:])
    return int(token + later[0]) if later.size else int(np.flatnonzero(allowed)[0])
