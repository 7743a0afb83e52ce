"""Grammar-constrained decoding: compile grammars over a model's vocabulary, track tokens, fill token masks.

Built on llguidance (chosen over xgrammar by measurement: docs/structured_generation.md). A
`GrammarCompiler` is made once per model; it compiles JSON schemas, regexes and Lark / GBNF grammars
into `Grammar`s, and a `Matcher` follows one sequence through a grammar. Before each step a matcher
fills the packed bitmask of the tokens it allows next (ceil(vocab / 32) int32 words, bit t % 32 of word
t // 32 = token t), which goes into `OutputSpec.allowed` as `mask.tobytes()`; the drawn token is then
passed to `Matcher.accept`.

Invariants: a matcher terminates when it accepts one of the model's stop tokens (allowed only where
the grammar may end) and accepts nothing after that; a refused token leaves it unchanged; a matcher
that can allow no token (terminated, or the grammar admits no token here) fills an all-zero mask,
which the sampler reports as an error for that row.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import llguidance as llg
import numpy as np
import numpy.typing as npt

from gpu_backend.loading.tokenizer import Tokenizer
from gpu_backend.types import BackendInfo
from gpu_backend.validate import mask_bytes

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

__all__ = ["Grammar", "GrammarCompiler", "Matcher", "mask_words", "schema_error", "token_bytes", "tokenizer_info"]

# JSON output as json.dumps writes it ('{"a": 1, "b": [2, 3]}'): no free whitespace, which a small
# model at temperature 1 can otherwise run on with ("\n\n\n...") until it hits max_tokens. Lenient:
# schemas as people write them compile; `format` is an annotation in JSON Schema (known formats such
# as date-time and email are enforced, unknown ones like "url" ignored). Keywords that cannot be
# enforced would be ignored too: `schema_error` is how a caller refuses those first.
_JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                     "lenient": True}
_STRICT: JsonCompileOptions = {**_JSON_OPTIONS, "lenient": False}
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[(.*)\]")
# Maps from names to subschemas: their keys are names, not keywords.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def schema_error(schema: Any) -> str | None:
    """Why `schema` (a parsed JSON Schema document) cannot be enforced as written, or None: a keyword
    no grammar enforces (`not`, `if`, `contains`, ...: each named with its JSON-pointer path), a bad
    type, a dangling `$ref`, a regex the engine lacks. Annotations (`title`, `description`, `examples`,
    `$comment`, unknown `format`s, ...) are fine. Needs no vocabulary: cheap enough for a request's boundary."""
    try:
        text = json.dumps(_without_formats(schema))
        reason = llg.LLMatcher.validate_grammar(llg.LLMatcher.grammar_from_json_schema(text, overrides=_STRICT))
    except (ValueError, RecursionError) as e:
        return str(e)
    if not reason:
        return None
    m = _UNIMPLEMENTED.search(reason)
    if m is None:
        return reason.split("\n")[0] if "regex" not in reason else " ".join(reason.split())
    keys = json.loads(f"[{m.group(1)}]")
    found = [f"{key!r} at {path or '/'}" for key in keys for path in _paths(schema, key, "")]
    return f"unsupported keyword{'s' if len(found) > 1 else ''}: {', '.join(found or keys)}"


def _without_formats(node: Any) -> Any:
    """The schema with its `format` annotations left out (for the strict check only: strict mode refuses
    an unknown format, which lenient mode, the one that compiles, ignores)."""
    if isinstance(node, dict):
        return {k: _without_formats(v) for k, v in node.items() if not (k == "format" and isinstance(v, str))}
    if isinstance(node, list):
        return [_without_formats(v) for v in node]
    return node


def _paths(node: Any, key: str, path: str, names: bool = False) -> list[str]:
    """JSON pointers of the schemas in `node` that use the keyword `key` (`names`: node maps names to schemas)."""
    out = []
    if isinstance(node, dict):
        if key in node and not names:
            out.append(path)
        for k, v in node.items():
            sub = f"{path}/{str(k).replace('~', '~0').replace('/', '~1')}"
            out.extend(_paths(v, key, sub, names=not names and k in _NAME_MAPS))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out.extend(_paths(v, key, f"{path}/{i}"))
    return out


def mask_words(vocab_size: int) -> int:
    """int32 words in the token bitmask of a `vocab_size`-token vocabulary."""
    return mask_bytes(vocab_size) // 4


def token_bytes(tokenizer: Tokenizer, vocab_size: int | None = None) -> list[bytes]:
    """The bytes of every token id (`Tokenizer.token_bytes`: special tokens as their text), and b""
    for ids the tokenizer does not define (a model vocabulary padded past the tokenizer's)."""
    out = list(tokenizer.token_bytes)
    n = len(out) if vocab_size is None else vocab_size
    return out[:n] + [b""] * (n - len(out))


class _Vocab:
    """What llguidance's TokenizerWrapper reads: token bytes, specials, EOS, and an encoder for literals."""

    def __init__(self, tokenizer: Tokenizer, tokens: list[bytes], stop_tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self.special_token_ids = sorted(set(tokenizer.spec.special.values()) | set(stop_tokens))
        self.eos_token_id = stop_tokens[0]
        self.bos_token_id = tokenizer.spec.bos_token_id
        self._encode = tokenizer.encode_ordinary

    def __call__(self, data: bytes) -> list[int]:
        # llguidance passes valid UTF-8 here (it tokenizes a trailing partial character itself)
        return self._encode(data.decode("utf-8", errors="replace"))


class _BytesVocab:
    """A `_Vocab` from token bytes alone: literals are encoded greedily, longest token first."""

    def __init__(self, tokens: list[bytes], special: Sequence[int], stop_tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self.special_token_ids = sorted(set(special) | set(stop_tokens))
        self.eos_token_id = stop_tokens[0]
        self.bos_token_id = None
        skip = set(self.special_token_ids)
        self._ids = {b: i for i, b in reversed(list(enumerate(tokens))) if b and i not in skip}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, data: bytes) -> list[int]:
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                t = self._ids.get(data[i:i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                raise ValueError(f"the vocabulary cannot spell byte {data[i]:#x}")
        return out


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_tokens: Sequence[int]) -> llg.LLTokenizer:
    """llguidance's view of our vocabulary: the bytes of every id, the specials (produced only where a
    grammar names them), and the model's stop tokens as EOS. Takes ~0.1 s; build it once per model."""
    if not stop_tokens:
        raise ValueError("tokenizer_info: the model has no stop token (a grammar needs one to end on)")
    tokens = token_bytes(tokenizer, vocab_size)
    # a SentencePiece-style tokenizer prepends a space to any text it encodes: fragments are spelled
    # greedily from the token bytes instead
    vocab: _Vocab | _BytesVocab = (_Vocab(tokenizer, tokens, stop_tokens) if tokenizer.byte_level
                                   else _BytesVocab(tokens, sorted(tokenizer.spec.special.values()), stop_tokens))
    return llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=vocab_size, eos_token=list(stop_tokens))


class Grammar:
    """A grammar compiled against one model's vocabulary; start any number of `Matcher`s from it."""

    def __init__(self, kind: str, matcher: llg.LLMatcher, stop_tokens: frozenset[int], vocab_size: int) -> None:
        self.kind = kind  # "json_schema", "regex", "lark", "ebnf" or "any_json"
        self._proto = matcher  # never advanced: matchers are deep copies of it
        self.stop_tokens = stop_tokens
        self.vocab_size = vocab_size

    def __repr__(self) -> str:
        return f"Grammar({self.kind})"


class GrammarCompiler:
    """Compiles grammars for one model. Compile errors raise ValueError with the library's reason."""

    def __init__(self, tokenizer: Tokenizer, info: BackendInfo, threads: int | None = None) -> None:
        """`info` gives the vocabulary size (the mask width) and the stop tokens; `threads` is the
        pool size for `fill_masks` (None = llguidance's default, 80% of the CPUs up to 32)."""
        self.vocab_size = info.vocab_size
        self.stop_tokens = frozenset(info.stop_tokens)
        self.info = tokenizer_info(tokenizer, info.vocab_size, info.stop_tokens)
        self._executor = llg.LLExecutor(num_threads=threads)

    @classmethod
    def from_token_bytes(cls, tokens: list[bytes], info: BackendInfo, special: Sequence[int] = ()) -> GrammarCompiler:
        """A compiler for a vocabulary given as the bytes of every id (`special` ids and the stop tokens
        are never text): for tokenizers other than the byte-level BPE one (stand-ins, test models)."""
        if len(tokens) != info.vocab_size or not info.stop_tokens:
            raise ValueError(f"from_token_bytes: need {info.vocab_size} tokens and a stop token, got "
                             f"{len(tokens)} tokens and stop tokens {list(info.stop_tokens)}")
        self = cls.__new__(cls)
        self.vocab_size, self.stop_tokens = info.vocab_size, frozenset(info.stop_tokens)
        vocab = _BytesVocab(tokens, special, info.stop_tokens)
        self.info = llg.LLTokenizer(llg.TokenizerWrapper(vocab), n_vocab=info.vocab_size,
                                    eos_token=list(info.stop_tokens))
        self._executor = llg.LLExecutor(num_threads=1)
        return self

    def json_schema(self, schema: str) -> Grammar:
        """JSON text matching `schema` (a JSON Schema document), written as json.dumps writes it."""
        try:
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"invalid JSON schema: {e}") from None
        return self._compile("json_schema", grammar, "invalid JSON schema")

    def regex(self, pattern: str) -> Grammar:
        """Text that fully matches `pattern` (Rust `regex` syntax, as Python's for the common cases)."""
        return self._compile("regex", llg.LLMatcher.grammar_from_regex(pattern), f"invalid regex {pattern!r}")

    def lark(self, text: str) -> Grammar:
        """A Lark grammar (llguidance's dialect: `start` rule, /regex/ terminals, `%json {...}`)."""
        return self._compile("lark", llg.LLMatcher.grammar_from_lark(text), "invalid Lark grammar")

    def ebnf(self, text: str) -> Grammar:
        """A GBNF grammar (llama.cpp's EBNF, `root ::= ...`) or a Lark one."""
        try:
            grammar = llg.grammar_from("ebnf", text)
        except ValueError as e:
            raise ValueError(f"invalid EBNF grammar: {e}") from None
        return self._compile("ebnf", grammar, "invalid EBNF grammar")

    def any_json(self) -> Grammar:
        """Any JSON value."""
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps({}), overrides=_JSON_OPTIONS)
        return self._compile("any_json", grammar, "any JSON")

    def _compile(self, kind: str, grammar: str, what: str) -> Grammar:
        m = llg.LLMatcher(self.info, grammar, log_level=0)
        if m.is_error():
            reason = _reason(m)
            if kind == "regex":  # drop the echo of the Lark rule llguidance wraps a regex in
                reason = reason.split("\n   1 | start: /", 1)[0]
            raise ValueError(f"{what}: {reason}")
        return Grammar(kind, m, self.stop_tokens, self.vocab_size)

    def fill_masks(self, matchers: Sequence[Matcher], out: npt.NDArray[np.int32]) -> None:
        """Fill row i of `out` ([>= len(matchers), mask_words] int32, C-contiguous) with matcher i's mask,
        all rows in parallel on the compiler's thread pool. Same result as `Matcher.fill_mask` per row."""
        words = mask_words(self.vocab_size)
        if out.ndim != 2 or out.shape[0] < len(matchers) or out.shape[1] != words:
            raise ValueError(f"fill_masks: out must have shape (>= {len(matchers)}, {words}), got {out.shape}")
        _check_mask_array(out, "fill_masks")
        for i, m in enumerate(matchers):
            if m.grammar.vocab_size != self.vocab_size:
                raise ValueError(f"fill_masks: matcher {i} is for a {m.grammar.vocab_size}-token vocabulary, "
                                 f"this compiler's has {self.vocab_size}")
        live = [(m._m, i) for i, m in enumerate(matchers) if not m.is_terminated()]
        if live:  # the executor refuses an empty list
            self._executor.unsafe_compute_mask_ptr(live, out.ctypes.data, out.shape[1] * 4, out.shape[0])
        for i, m in enumerate(matchers):
            if m.is_terminated() or m._m.is_error():
                out[i] = 0


class Matcher:
    """One sequence's position in a grammar: accepts tokens, rolls back, forks, fills the next mask."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        self._m = grammar._proto.deep_copy()
        self._count = 0  # tokens accepted, the stop token included
        self._stopped = False  # the last accepted token was a stop token

    # A stop token is kept here, not fed to llguidance: it is accepted where the grammar may end
    # (llguidance's mask then sets the EOS bits), and only the tokens before it are in the library's state.
    def accept(self, token: int) -> bool:
        """Advance by `token` if the grammar allows it here and return True; else return False, unchanged."""
        if self._stopped or not 0 <= token < self.grammar.vocab_size:
            return False
        if token in self.grammar.stop_tokens:
            if not self._m.is_accepting():
                return False
            self._stopped = True
        elif self._m.try_consume_tokens([token]) != 1:  # refuses without entering llguidance's error state
            return False
        self._count += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens (a terminated matcher that rolls back its stop token resumes)."""
        if not isinstance(n, int) or not 0 <= n <= self._count:
            raise ValueError(f"rollback: n must be an int in [0, {self._count}] (tokens accepted), got {n!r}")
        self._count -= n
        if n and self._stopped:
            self._stopped, n = False, n - 1
        if n and not self._m.rollback(n):
            raise RuntimeError(f"rollback({n}): {_reason(self._m)}")

    def is_terminated(self) -> bool:
        """True once a stop token was accepted: the output is complete and nothing more is accepted."""
        return self._stopped

    def reset(self) -> None:
        """Back to the grammar's start, as if no token had been accepted."""
        self._m = self.grammar._proto.deep_copy()
        self._count, self._stopped = 0, False

    def fork(self) -> Matcher:
        """An independent copy at the same position (for beams or speculative branches)."""
        twin = Matcher.__new__(Matcher)
        twin.grammar, twin._m = self.grammar, self._m.deep_copy()
        twin._count, twin._stopped = self._count, self._stopped
        return twin

    @property
    def accepted(self) -> int:
        """Tokens accepted since the start (or the last reset), net of rollbacks."""
        return self._count

    def fill_mask(self, out: npt.NDArray[np.int32] | None = None) -> npt.NDArray[np.int32]:
        """The packed bitmask of the tokens allowed next (`OutputSpec.allowed` is `mask.tobytes()`), written
        into `out` ([mask_words] int32, C-contiguous) when given. All zero when no token is allowed."""
        words = mask_words(self.grammar.vocab_size)
        if out is None:
            out = np.zeros(words, dtype=np.int32)
        if out.shape != (words,):
            raise ValueError(f"fill_mask: out must have shape ({words},), got {out.shape}")
        _check_mask_array(out, "fill_mask")
        if self.is_terminated():
            out[...] = 0
            return out
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.size * 4)
        if self._m.is_error():  # llguidance then allows only EOS; the grammar itself allows nothing
            out[...] = 0
        return out

    @property
    def error(self) -> str | None:
        """Why no token is allowed, when the grammar admits none at this position; else None."""
        return f"the grammar admits no token here ({_reason(self._m)})" if self._m.is_error() else None


def _reason(m: llg.LLMatcher) -> str:
    # llguidance appends a dump of the parser state after the reason; keep the reason
    return m.get_error().split("\n<state>", 1)[0].strip() or "the grammar admits no token here"


def _check_mask_array(out: npt.NDArray[np.int32], where: str) -> None:
    # the library writes through a raw pointer: the layout must be exactly this
    if out.dtype != np.int32 or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{where}: out must be a writable C-contiguous int32 array, got {out.dtype}")
