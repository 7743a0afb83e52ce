"""Structured generation: grammars that constrain what `Context.generate` may produce.

    from inferlet import Context, Sampler, json_schema, regex, choice

    with Context() as ctx:
        ctx.fill_user("Describe a cat as JSON.")
        text = ctx.generate(Sampler(temperature=1.0), max_tokens=200,
                            grammar=json_schema({"type": "object", "properties": {"name": {"type": "string"}}}))

A `Grammar` is a description (making one calls no host); the host compiles it against the model's
vocabulary on first use in this instance and keeps it. Each constrained generation follows the
grammar with a `Matcher`: the host masks every draw to the tokens the grammar allows and advances
the matcher with the drawn token, and the generation ends when the grammar's output is complete
(the model's stop token, allowed only there, is drawn). Errors (a bad schema or regex, a grammar
that admits no token) raise `GrammarError` with the host's reason.
"""

from __future__ import annotations

import json
from typing import Any

from inferlet import _host

__all__ = ["Grammar", "GrammarError", "Matcher", "any_json", "choice", "ebnf", "json_schema", "lark", "regex"]

_KINDS = ("json_schema", "regex", "ebnf", "lark", "any_json")
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")


class GrammarError(Exception):
    """The host refused a grammar (naming the problem), or the grammar admits no token where it is used."""


class Grammar:
    """A grammar: JSON text matching a schema, text matching a regex, an EBNF/Lark grammar, or any JSON.

    Compiled by the host on first use (`compiled()`), then kept for this instance's life."""

    def __init__(self, kind: str, source: str = "") -> None:
        if kind not in _KINDS:
            raise ValueError(f"unknown grammar kind {kind!r} (one of {', '.join(_KINDS)})")
        self.kind, self.source = kind, source
        self._compiled: Any = None

    def __repr__(self) -> str:
        return f"Grammar({self.kind}, {self.source[:40]!r})"

    def compiled(self) -> Any:
        """The host's grammar resource (compiled once). Raises GrammarError with the host's reason."""
        if self._compiled is None:
            g = _host.grammar.Grammar
            make = {"json_schema": g.from_json_schema, "regex": g.from_regex, "ebnf": g.from_ebnf,
                    "lark": g.from_lark}.get(self.kind)
            try:
                self._compiled = g.any_json() if make is None else make(self.source)
            except _host.Err as e:
                raise GrammarError(str(e.value)) from None
        return self._compiled

    def matcher(self) -> Matcher:
        """A new matcher at the start of this grammar."""
        try:
            return Matcher(self.compiled().matcher())
        except _host.Err as e:
            raise GrammarError(str(e.value)) from None


class Matcher:
    """One sequence's position in a grammar (a host resource): accept, roll back, fork, reset."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def accept(self, tokens: list[int]) -> int:
        """Accept `tokens` in order up to the first one the grammar refuses; how many were accepted."""
        n: int = self.handle.accept(list(tokens))
        return n

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        self.handle.rollback(n)

    @property
    def accepted(self) -> int:
        """Tokens accepted since the start (or the last reset), net of rollbacks."""
        n: int = self.handle.accepted()
        return n

    def is_terminated(self) -> bool:
        """True once the grammar's output is complete (a stop token was accepted)."""
        done: bool = self.handle.is_terminated()
        return done

    def reset(self) -> None:
        self.handle.reset()

    def fork(self) -> Matcher:
        """An independent copy at the same position."""
        try:
            return Matcher(self.handle.fork())
        except _host.Err as e:
            raise GrammarError(str(e.value)) from None


def json_schema(schema: dict[str, Any] | str | bool | None = None) -> Grammar:
    """JSON text matching `schema` (a JSON Schema as a dict or JSON text); None: any JSON object."""
    if schema is None:
        schema = {"type": "object"}
    return Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema))


def regex(pattern: str) -> Grammar:
    """Text that fully matches `pattern` (Rust `regex` syntax: Python's for the common cases)."""
    return Grammar("regex", pattern)


def ebnf(text: str) -> Grammar:
    """A GBNF grammar (llama.cpp's EBNF: `root ::= ...`)."""
    return Grammar("ebnf", text)


def lark(text: str) -> Grammar:
    """A Lark grammar (llguidance's dialect: a `start` rule, /regex/ terminals)."""
    return Grammar("lark", text)


def any_json() -> Grammar:
    """Any JSON value."""
    return Grammar("any_json")


def choice(options: list[str]) -> Grammar:
    """Exactly one of `options`: generation picks among them by the model's probabilities (each draw is
    over the tokens that continue some option, like vLLM's guided choice / SGLang's `select` by sampling)."""
    opts = list(options)
    if not opts or any(not isinstance(o, str) or not o for o in opts):
        raise ValueError(f"choice needs a non-empty list of non-empty strings, got {options!r}")
    return Grammar("regex", "(?:" + "|".join("".join("\\" + c if c in _REGEX_META else c for c in o)
                                             for o in opts) + ")")
