"""Token masks: the sampler applies `OutputSpec.allowed`, validation checks its size, and the
`gpu_backend.grammar` wrapper compiles, matches and fills masks.

Fast: the sampler tests use synthetic logits, the wrapper tests a tiny byte-level vocabulary (the real
model's run in tests/test_grammar_e2e.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from gpu_backend import ForwardRequest, OutputSpec, SamplerParams
from gpu_backend import sampling as sampling_mod
from gpu_backend.grammar import GrammarCompiler, Matcher, mask_words, token_bytes
from gpu_backend.loading.model_files import TokenizerSpec
from gpu_backend.loading.tokenizer import Tokenizer, _unicode_to_byte
from gpu_backend.sampling import SampleError, Sampler
from gpu_backend.validate import check_request

V = 50
CPU = torch.device("cpu")


def pack(ids: set[int] | list[int], vocab: int = V) -> bytes:
    bits = np.zeros(mask_words(vocab) * 32, dtype=bool)
    bits[list(ids)] = True
    return np.packbits(bits, bitorder="little").tobytes()


def unpack(mask: np.ndarray) -> set[int]:
    return set(np.nonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))[0].tolist())


def logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    """Model-like rows: values around 25, spread 4, a clear maximum at token 17."""
    x = torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 4 + 25
    x[:, 17] = x.max() + 3
    return x


# -- the sampler -----------------------------------------------------------------------------------

ALLOWED = {3, 8, 21, 40, 49}
SAMPLERS = [SamplerParams(temperature=1.0), SamplerParams(temperature=5.0, top_k=3),
            SamplerParams(temperature=1.0, top_p=0.9), SamplerParams(temperature=2.0, min_p=0.05)]


@pytest.mark.parametrize("params", SAMPLERS, ids=repr)
def test_drawn_token_is_always_allowed(params):
    s = Sampler(CPU, seed=7)
    lg = logits(400, seed=1)
    res = s(lg, [OutputSpec(index=0, sample=params, allowed=pack(ALLOWED))] * 400)
    drawn = {r.token for r in res}
    assert drawn <= ALLOWED and len(drawn) > 1


def test_greedy_picks_the_best_allowed_token():
    lg = logits(1)
    best = max(ALLOWED, key=lambda t: lg[0, t].item())
    res = Sampler(CPU)(lg, [OutputSpec(index=0, sample=SamplerParams(), allowed=pack(ALLOWED))])
    assert res[0].token == best != 17


def test_dist_covers_only_allowed_tokens():
    lg = logits(1)
    (res,) = Sampler(CPU)(lg, [OutputSpec(index=0, dist=10, allowed=pack({5, 17, 30}))])
    assert set(res.ids) == {5, 17, 30} and res.ids[0] == 17
    expected = torch.softmax(lg[0, [5, 17, 30]], -1)
    assert sorted(res.probs, reverse=True) == pytest.approx(sorted(expected.tolist(), reverse=True))
    assert res.probs == sorted(res.probs, reverse=True)


def test_masked_and_unmasked_rows_mix_without_changing_each_other():
    lg = logits(6, seed=2)
    specs = [OutputSpec(index=0, sample=SamplerParams(temperature=1.0, seed=100 + i), dist=4) for i in range(6)]
    masked = {1: pack(ALLOWED), 4: pack({0, 1, 2})}
    mixed = [OutputSpec(index=0, sample=s.sample, dist=4, allowed=masked.get(i)) for i, s in enumerate(specs)]
    together = Sampler(CPU)(lg, mixed)
    for i, spec in enumerate(mixed):
        alone = Sampler(CPU)(lg[i : i + 1], [spec])[0]
        assert (together[i].token, together[i].ids, together[i].probs) == (alone.token, alone.ids, alone.probs)
        if i not in masked:  # and exactly what the row gets without any mask in the batch
            plain = Sampler(CPU)(lg[i : i + 1], [specs[i]])[0]
            assert (together[i].token, together[i].ids, together[i].probs) == (plain.token, plain.ids, plain.probs)
    assert together[1].token in ALLOWED and together[4].token in {0, 1, 2}


def test_a_mask_allowing_nothing_fails_its_row_only():
    lg = logits(3)
    specs = [OutputSpec(index=0, sample=SamplerParams(temperature=1.0)),
             OutputSpec(index=0, sample=SamplerParams(), allowed=pack(set())),
             OutputSpec(index=0, sample=SamplerParams(), allowed=pack({4}))]
    with pytest.raises(SampleError, match="output row 1: its allowed-token mask allows no token") as exc:
        Sampler(CPU)(lg, specs)
    assert exc.value.row == 1
    assert [r.token for r in Sampler(CPU)(lg[[2]], specs[2:])] == [4]


def test_a_batch_without_masks_does_no_mask_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("mask work in a batch without masks")

    monkeypatch.setattr(sampling_mod, "unpack_masks", boom)
    res = Sampler(CPU)(logits(2), [OutputSpec(index=0, sample=SamplerParams(), dist=2)] * 2)
    assert [r.token for r in res] == [17, 17]


def test_unpack_masks_reads_little_endian_words():
    bits = sampling_mod.unpack_masks([pack({0, 31, 32, 49})], V, CPU)
    assert bits.shape == (1, V) and set(torch.nonzero(bits[0]).flatten().tolist()) == {0, 31, 32, 49}


# -- validation ------------------------------------------------------------------------------------


@dataclass
class Info:
    """The BackendInfo fields the validator and the grammar compiler read."""

    vocab_size: int = V
    stop_tokens: list[int] = field(default_factory=lambda: [1])
    page_size: int = 16
    num_pages: int = 8
    max_position: int = 0


def request(allowed: object) -> ForwardRequest:
    return ForwardRequest(pages=[0], last_page_len=2, tokens=[5, 6], positions=[0, 1], name="r",
                          outputs=[OutputSpec(index=1, sample=SamplerParams(), allowed=allowed)])  # type: ignore[arg-type]


def test_validation_checks_the_mask_size_and_type():
    assert check_request(request(pack({1})), Info()).checked
    with pytest.raises(ValueError, match="forward request 'r': output 0: allowed is 4 bytes, expected 8"):
        check_request(request(b"\xff" * 4), Info())
    with pytest.raises(ValueError, match="output 0: allowed must be bytes .* got list"):
        check_request(request([1, 2]), Info())


# -- the wrapper, on a tiny byte-level vocabulary ----------------------------------------------------

TINY_WORDS = [b"he", b"ll", b"hello", b" 4", b"42", b'{"', b'":', b"true", b"<|"]
TINY_SPECIAL = {"<|endoftext|>": 0, "<|im_end|>": 1}
TINY_VOCAB = 300  # 267 defined, then padding the tokenizer does not define
PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    to_char = {b: c for c, b in _unicode_to_byte().items()}
    tokens = list(TINY_SPECIAL) + ["".join(to_char[b] for b in w) for w in [bytes([i]) for i in range(256)] + TINY_WORDS]
    spec = TokenizerSpec(tokens=tokens, special=TINY_SPECIAL, pattern=PATTERN, chat_template="",
                         bos_token_id=None, eos_token_id=1, pad_token_id=None, stop_tokens=[1])
    return Tokenizer(spec, "tiny")


@pytest.fixture(scope="module")
def compiler(tiny) -> GrammarCompiler:
    return GrammarCompiler(tiny, Info(vocab_size=TINY_VOCAB, stop_tokens=[1]), threads=1)


def tid(tiny: Tokenizer, text: bytes) -> int:
    return token_bytes(tiny).index(text)


def test_token_bytes_cover_every_id(tiny):
    tb = token_bytes(tiny, TINY_VOCAB)
    assert len(tb) == TINY_VOCAB and tb[0] == b"<|endoftext|>" and tb[2 + ord("a")] == b"a"
    assert tb[2 + 256 + 2] == b"hello" and tb[-1] == b""


@pytest.mark.parametrize("make, message", [
    (lambda c: c.regex("a(b"), r"invalid regex 'a\(b'.*unclosed group"),
    (lambda c: c.regex("[z-a]"), r"invalid regex '\[z-a\]'.*invalid character class range"),
    (lambda c: c.json_schema('{"type": "strnig"}'), "invalid JSON schema: Invalid type: strnig"),
    (lambda c: c.json_schema("{not json"), "invalid JSON schema: key must be a string"),
    (lambda c: c.json_schema('{"type": "integer", "minimum": 5, "maximum": 3}'),
     r"invalid JSON schema: Unsatisfiable schema: minimum \(5\) is greater than maximum \(3\)"),
    (lambda c: c.lark("start: missing"), 'invalid Lark grammar: .*unknown name: "missing"'),
    (lambda c: c.ebnf('root ::= "a" missing'), "invalid EBNF grammar: .*'missing' not found"),
], ids=["regex group", "regex range", "schema type", "schema text", "schema bounds", "lark", "ebnf"])
def test_compile_errors_name_the_problem(compiler, make, message):
    with pytest.raises(ValueError, match=f"(?s){message}"):
        make(compiler)


def test_mask_follows_the_grammar(tiny, compiler):
    m = Matcher(compiler.regex("hel+o 4[0-9]"))
    first = unpack(m.fill_mask())
    assert first == {tid(tiny, b"h"), tid(tiny, b"he"), tid(tiny, b"hello")}  # "hello" as one token fits too
    for word in (b"he", b"ll", b"o"):
        assert m.accept(tid(tiny, word))
    # text the grammar forces is offered as the tokenizer would split it: " 4" is pre-split into " ", "4"
    assert unpack(m.fill_mask()) == {tid(tiny, b" ")}
    assert m.accept(tid(tiny, b" ")) and m.accept(tid(tiny, b"4"))
    assert unpack(m.fill_mask()) == {tid(tiny, str(d).encode()) for d in range(10)}  # not complete: no stop
    assert m.accept(tid(tiny, b"2"))
    assert unpack(m.fill_mask()) == {1}  # complete: only the stop token


def test_refused_tokens_leave_the_matcher_unchanged(tiny, compiler):
    m = Matcher(compiler.regex("ab"))
    before = m.fill_mask().copy()
    for t in (tid(tiny, b"b"), 1, 0, TINY_VOCAB - 1, TINY_VOCAB, -1):  # wrong, early stop, special, padding, out of range
        assert not m.accept(t)
    assert np.array_equal(m.fill_mask(), before) and m.accepted == 0 and m.error is None


def test_stop_token_terminates_and_rollback_resumes(tiny, compiler):
    m = Matcher(compiler.regex("ab"))
    assert m.accept(tid(tiny, b"a")) and m.accept(tid(tiny, b"b")) and not m.is_terminated()
    assert m.accept(1) and m.is_terminated() and m.accepted == 3
    assert not m.accept(1) and not m.accept(tid(tiny, b"a"))
    assert not m.fill_mask().any()
    m.rollback(1)
    assert not m.is_terminated() and unpack(m.fill_mask()) == {1}
    m.rollback(2)
    assert m.accepted == 0 and unpack(m.fill_mask()) == {tid(tiny, b"a")}
    with pytest.raises(ValueError, match=r"rollback: n must be an int in \[0, 0\]"):
        m.rollback(1)


def test_fork_is_independent_and_reset_restarts(tiny, compiler):
    m = Matcher(compiler.regex("[a-c]+"))
    m.accept(tid(tiny, b"a"))
    twin = m.fork()
    assert twin.accept(tid(tiny, b"b")) and twin.accept(1) and twin.is_terminated()
    assert m.accepted == 1 and not m.is_terminated() and 1 in unpack(m.fill_mask())
    twin.reset()
    assert twin.accepted == 0 and not twin.is_terminated() and 1 not in unpack(twin.fill_mask())


def test_json_schema_output_is_written_like_json_dumps(tiny, compiler):
    m = Matcher(compiler.json_schema('{"type": "object", "properties": {"a": {"type": "boolean"}}, '
                                     '"required": ["a"], "additionalProperties": false}'))
    text = b'{"a": true}'
    ids = [tid(tiny, w) for w in (b'{"', b"a", b'":', b" ", b"true", b"}")]
    assert b"".join(token_bytes(tiny)[i] for i in ids) == text
    assert all(m.accept(t) for t in ids) and m.accept(1) and m.is_terminated()
    any_json = Matcher(compiler.any_json())
    assert not any_json.accept(tid(tiny, b" ")) and 0 not in unpack(any_json.fill_mask())


def test_specials_and_padding_are_never_text(tiny, compiler):
    mask = unpack(Matcher(compiler.regex("(.|\n)*")).fill_mask())
    assert 0 not in mask and not any(t >= 267 for t in mask)
    assert tid(tiny, b"<|") in mask and 1 in mask  # "<|" is text; the stop token may end the empty match


def test_fill_masks_matches_fill_mask_row_by_row(tiny, compiler):
    g = compiler.regex("(he|ll|o)+ 4[0-9]")
    ms = [Matcher(g) for _ in range(4)]
    ms[1].accept(tid(tiny, b"he"))
    for i, words in ((2, [b"hello", b" "]), (3, [b"o", b" ", b"4", b"2"])):
        assert all(ms[i].accept(tid(tiny, w)) for w in words)
    assert ms[3].accept(1)
    out = np.full((5, mask_words(TINY_VOCAB)), -1, dtype=np.int32)
    compiler.fill_masks(ms, out)
    for i, m in enumerate(ms):
        assert np.array_equal(out[i], m.fill_mask()), i
    assert not out[3].any() and (out[4] == -1).all()  # terminated: nothing; rows past the matchers: untouched
    compiler.fill_masks([], out)  # nothing to fill
    compiler.fill_masks(ms[3:], out)  # only terminated matchers
    assert not out[0].any()
    with pytest.raises(ValueError, match=r"fill_masks: out must have shape \(>= 4, 10\)"):
        compiler.fill_masks(ms, np.zeros((3, 10), dtype=np.int32))
    with pytest.raises(ValueError, match="writable C-contiguous int32"):
        compiler.fill_masks(ms, np.zeros((4, 10), dtype=np.int64))


def test_a_grammar_admitting_no_token_gives_an_empty_mask_and_a_reason(compiler):
    m = Matcher(compiler.lark("start: NOTHING\nNOTHING: /[a-z]+/ & /[0-9]+/"))  # letters and digits at once
    assert not m.fill_mask().any()
    assert m.error is not None and "admits no token" in m.error


def test_schema_error_passes_annotations_and_names_unenforceable_keywords_with_their_path() -> None:
    """Issue 39: real-world schemas (format "url", titles, examples) are fine; what no grammar can
    enforce is named with its JSON pointer, a property called like a keyword is not a keyword."""
    from gpu_backend.grammar import schema_error

    assert schema_error({"$schema": "http://json-schema.org/draft-07/schema#", "title": "t", "$comment": "c",
                         "type": "object", "properties": {"home": {"type": "string", "format": "url",
                                                                   "examples": ["x"], "default": "y"},
                                                          "not": {"type": "integer"}}}) is None
    assert schema_error({"type": "object", "properties": {"a": {"not": {"type": "string"}},
                                                          "not": {"type": "string"}}}) == \
        "unsupported keyword: 'not' at /properties/a"
    assert schema_error({"$defs": {"x": {"if": {}, "then": {}}}, "$ref": "#/$defs/x"}) == \
        "unsupported keywords: 'if' at /$defs/x, 'then' at /$defs/x"
    assert schema_error({"type": "strin"}) == "Invalid type: strin"
    assert "look-around" in (schema_error({"type": "string", "pattern": "(?=a)"}) or "")


@pytest.mark.parametrize(("name", "refused"), [("package_json", None), ("k8s_container", None),
                                               ("github_workflow_step", "unsupported keyword: 'dependencies' at /")])
def test_real_world_schemas_compile_or_name_what_they_cannot_enforce(compiler, name: str, refused: str | None):
    """Issue 39: fragments of SchemaStore's package.json and GitHub workflow schemas and a Kubernetes
    container (formats "url" / "int32", `x-kubernetes-*`, `markdownDescription`, a property named
    "if"): the accepted ones compile (leniently) and their matcher takes a valid document."""
    import json
    from pathlib import Path

    from gpu_backend.grammar import Matcher, schema_error

    schema = json.loads((Path(__file__).parent / "fixtures" / "schemas" / f"{name}.json").read_text())
    assert schema_error(schema) == refused
    if refused is None:
        m = Matcher(compiler.json_schema(json.dumps(schema)))
        doc = {"package_json": {"name": "a", "version": "1"}, "k8s_container": {"name": "web"}}[name]
        for t in compiler.info.tokenize_str(json.dumps(doc)):
            assert m.accept(t), (name, doc)
        assert m.accept(1) and m.is_terminated()
