"""WIT interface `grammar` (0.2.0): the `grammar` and `matcher` resources of structured generation.

Grammars are compiled with `gpu_backend.grammar` (llguidance) against the served model's vocabulary;
the compiler is made on first use. Every grammar and matcher lives in its instance's table, keyed
by the rep of its resource handle (reps are unique in the host): a handle resolves only in the
instance that holds it, a guest drop frees it, and `release` frees the whole table when the
instance ends, however it ends. Limits per instance: `MAX_GRAMMARS` live grammars, `MAX_MATCHERS`
live matchers, `MAX_SOURCE_BYTES` of source per grammar; past them the call returns an error.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wasmtime
from wasmtime.component import ResourceAny, ResourceHost, ResourceType

from gpu_backend.grammar import Grammar, GrammarCompiler, Matcher
from gpu_backend.loading.tokenizer import Tokenizer as ByteTokenizer
from gpu_backend.types import BackendInfo, Tokenizer
from host.api.guest import GuestError, Import, guest_import
from host.wasm.instance import Instance, current

__all__ = ["Grammars", "HostMatcher", "imports", "resources", "GRAMMAR_TYPE", "MATCHER_TYPE",
           "MAX_GRAMMARS", "MAX_MATCHERS", "MAX_SOURCE_BYTES"]

GRAMMAR_TYPE, MATCHER_TYPE = 0x50494547, 0x5049454D  # host resource type ids ("PIEG", "PIEM")
MAX_GRAMMARS = 64
MAX_MATCHERS = 1024
MAX_SOURCE_BYTES = 256 * 1024

ResourceDtor = Callable[[Any, int], None]


class HostMatcher:
    """A guest's matcher: `busy` while a pass it constrains is not yet done (calls on it then trap)."""

    __slots__ = ("matcher", "busy")

    def __init__(self, matcher: Matcher) -> None:
        self.matcher = matcher
        self.busy = False


@dataclass
class _Table:
    grammars: dict[int, Grammar] = field(default_factory=dict)
    matchers: dict[int, HostMatcher] = field(default_factory=dict)


class Grammars:
    """The host's grammar compiler and every instance's grammars and matchers."""

    def __init__(self, tokenizer: Tokenizer, info: BackendInfo) -> None:
        self._tokenizer, self._info = tokenizer, info
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._tables: dict[str, _Table] = {}
        self._reps = itertools.count(1)

    def compiler(self) -> GrammarCompiler:
        """The model's compiler, made on first use."""
        with self._lock:
            if self._compiler is None:
                if isinstance(self._tokenizer, ByteTokenizer):
                    self._compiler = GrammarCompiler(self._tokenizer, self._info)
                else:  # a stand-in model: each id's decoded text as its bytes
                    dec = self._tokenizer.decode
                    tokens = [dec([i]).encode() for i in range(self._info.vocab_size)]
                    self._compiler = GrammarCompiler.from_token_bytes(tokens, self._info)
            return self._compiler

    def table(self, inst: Instance) -> _Table:
        t = self._tables.get(inst.id)
        if t is None:
            inst.check_alive()  # an ended instance gets no new table (release has run or will)
            t = self._tables.setdefault(inst.id, _Table())
        return t

    def release(self, inst: Instance) -> None:
        """Free every grammar and matcher of `inst` (it has ended)."""
        self._tables.pop(inst.id, None)

    def release_rep(self, inst: Instance | None, rep: int, kind: str) -> None:
        """A guest dropped a handle: forget its entry (nothing to do once the instance's table is gone)."""
        t = None if inst is None else self._tables.get(inst.id)
        if t is not None:
            getattr(t, kind).pop(rep, None)

    def new_rep(self) -> int:
        return next(self._reps) % 2**32 or next(self._reps)

    def add_grammar(self, inst: Instance, grammar: Grammar) -> ResourceHost | str:
        t = self.table(inst)
        if len(t.grammars) >= MAX_GRAMMARS:
            return f"this instance already holds {MAX_GRAMMARS} grammars (the limit): drop one first"
        rep = self.new_rep()
        t.grammars[rep] = grammar
        return ResourceHost.own(rep, GRAMMAR_TYPE)

    def add_matcher(self, inst: Instance, matcher: Matcher) -> ResourceHost | str:
        t = self.table(inst)
        if len(t.matchers) >= MAX_MATCHERS:
            return f"this instance already holds {MAX_MATCHERS} matchers (the limit): drop one first"
        rep = self.new_rep()
        t.matchers[rep] = HostMatcher(matcher)
        return ResourceHost.own(rep, MATCHER_TYPE)

    def grammar(self, inst: Instance, store: Any, handle: ResourceAny) -> Grammar:
        g = self.table(inst).grammars.get(_rep(store, handle, "grammar"))
        if g is None:
            raise GuestError("unknown grammar handle (not this instance's, or dropped)")
        return g

    def matcher(self, inst: Instance, store: Any, handle: ResourceAny, idle: bool = True) -> HostMatcher:
        """The matcher behind a borrowed handle; with `idle`, trap if a pass it constrains is in flight."""
        m = self.table(inst).matchers.get(_rep(store, handle, "matcher"))
        if m is None:
            raise GuestError("unknown matcher handle (not this instance's, or dropped)")
        if idle and m.busy:
            raise GuestError("the matcher constrains a pass not yet waited on")
        return m


def _current() -> Instance | None:
    try:
        return current()
    except wasmtime.WasmtimeError:  # a drop outside any instance's call: its table is released with it
        return None


def _rep(store: Any, handle: Any, what: str) -> int:
    if not isinstance(handle, ResourceAny):
        raise GuestError(f"expected a {what} handle, got {type(handle).__name__}")
    try:
        rep: int = handle.to_host(store).rep
    except wasmtime.WasmtimeError as e:
        raise GuestError(f"bad {what} handle: {e}") from None
    return rep


def resources(g: Grammars) -> dict[str, tuple[ResourceType, ResourceDtor]]:
    """The interface's resource types and their destructors (a guest drop frees the entry)."""

    def drop_grammar(_store: Any, rep: int) -> None:
        g.release_rep(_current(), rep, "grammars")

    def drop_matcher(_store: Any, rep: int) -> None:
        g.release_rep(_current(), rep, "matchers")

    return {"grammar": (ResourceType.host(GRAMMAR_TYPE), drop_grammar),
            "matcher": (ResourceType.host(MATCHER_TYPE), drop_matcher)}


def imports(g: Grammars) -> dict[str, Import]:
    def compile_with(name: str, build: Callable[[GrammarCompiler, str], Grammar]) -> Import:
        @guest_import(f"grammar.[static]grammar.{name}")
        def make(inst: Instance, source: str) -> ResourceHost | str:
            if len(source.encode()) > MAX_SOURCE_BYTES:
                return f"the grammar source is {len(source.encode())} bytes, over the limit of {MAX_SOURCE_BYTES}"
            try:
                grammar = build(g.compiler(), source)
            except ValueError as e:
                return str(e)
            return g.add_grammar(inst, grammar)

        return make

    @guest_import("grammar.[static]grammar.any-json")
    def any_json(inst: Instance) -> ResourceHost | str:
        try:
            grammar = g.compiler().any_json()
        except ValueError as e:
            return str(e)
        return g.add_grammar(inst, grammar)

    @guest_import("grammar.[method]grammar.matcher", store=True)
    def new_matcher(inst: Instance, store: Any, handle: ResourceAny) -> ResourceHost | str:
        return g.add_matcher(inst, Matcher(g.grammar(inst, store, handle)))

    @guest_import("grammar.[method]matcher.accept", store=True)
    def accept(inst: Instance, store: Any, handle: ResourceAny, tokens: list[int]) -> int:
        m = g.matcher(inst, store, handle).matcher
        n = 0
        for t in tokens:
            if not m.accept(t):
                break
            n += 1
        return n

    @guest_import("grammar.[method]matcher.rollback", store=True)
    def rollback(inst: Instance, store: Any, handle: ResourceAny, n: int) -> None:
        m = g.matcher(inst, store, handle).matcher
        if n > m.accepted:
            raise GuestError(f"rollback of {n} tokens, but the matcher has accepted only {m.accepted}")
        m.rollback(n)

    @guest_import("grammar.[method]matcher.accepted", store=True)
    def accepted(inst: Instance, store: Any, handle: ResourceAny) -> int:
        return g.matcher(inst, store, handle).matcher.accepted

    @guest_import("grammar.[method]matcher.is-terminated", store=True)
    def is_terminated(inst: Instance, store: Any, handle: ResourceAny) -> bool:
        return g.matcher(inst, store, handle).matcher.is_terminated()

    @guest_import("grammar.[method]matcher.reset", store=True)
    def reset(inst: Instance, store: Any, handle: ResourceAny) -> None:
        g.matcher(inst, store, handle).matcher.reset()

    @guest_import("grammar.[method]matcher.fork", store=True)
    def fork(inst: Instance, store: Any, handle: ResourceAny) -> ResourceHost | str:
        return g.add_matcher(inst, g.matcher(inst, store, handle).matcher.fork())

    return {
        "[static]grammar.from-json-schema": compile_with("from-json-schema", GrammarCompiler.json_schema),
        "[static]grammar.from-regex": compile_with("from-regex", GrammarCompiler.regex),
        "[static]grammar.from-ebnf": compile_with("from-ebnf", GrammarCompiler.ebnf),
        "[static]grammar.from-lark": compile_with("from-lark", GrammarCompiler.lark),
        "[static]grammar.any-json": any_json, "[method]grammar.matcher": new_matcher,
        "[method]matcher.accept": accept, "[method]matcher.rollback": rollback,
        "[method]matcher.accepted": accepted, "[method]matcher.is-terminated": is_terminated,
        "[method]matcher.reset": reset, "[method]matcher.fork": fork,
    }
