"""Grammar-constrained generation on the real model: a Python driver loop over `backend.forward` and
`gpu_backend.grammar` matchers (fill the mask -> OutputSpec(allowed=...) -> accept the drawn token).

Every run samples at temperature 1 with its own seed (deterministic); the runs of one grammar go
through the model as one batch.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema
import numpy as np
import pytest

from gpu_backend import ForwardError, ForwardRequest, OutputSpec, SamplerParams
from gpu_backend.grammar import Grammar, GrammarCompiler, Matcher, mask_words

RUNS = 20
MAX_TOKENS = 60

SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {"type": "object",
                     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                                    "id": {"type": "integer", "minimum": 1, "maximum": 999}},
                     "required": ["name", "id"], "additionalProperties": False},
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array with bounds": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "minItems": 2, "maxItems": 4}},
        "required": ["colors"],
        "additionalProperties": False,
    },
    "enum and ranges": {
        "type": "object",
        "properties": {"size": {"enum": ["S", "M", "L"]},
                       "count": {"type": "integer", "minimum": -5, "maximum": 20},
                       "ratio": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["size", "count", "ratio"],
        "additionalProperties": False,
    },
    "optional keys": {
        "type": "object",
        "properties": {"title": {"type": "string", "minLength": 1, "maxLength": 16},
                       "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}},
        "required": ["title"],
        "additionalProperties": False,
    },
}
REGEXES = [r"[0-9]{3}-[0-9]{4}", r"(cat|dog|bird)s? and (red|blue) [a-z]{1,6}"]


@pytest.fixture(scope="module")
def compiler(backend) -> GrammarCompiler:
    return GrammarCompiler(backend.tokenizer, backend.info)


def prompt(backend, request: str) -> list[int]:
    tok = backend.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": request}]))


def generate(backend, compiler: GrammarCompiler, grammars: list[Grammar | None], prompt_ids: list[int],
             seed: int, max_tokens: int = MAX_TOKENS) -> list[tuple[list[int], bool]]:
    """One sequence per entry of `grammars` (None = unconstrained), decoded together in lock step;
    sequence i draws with seeds from `seed + i`, so it gets the same tokens alone with that seed.

    Returns, per sequence, its tokens (without the stop token) and whether it ended on a stop token.
    """
    ps, n = backend.info.page_size, len(grammars)
    need = math.ceil((len(prompt_ids) + max_tokens) / ps)
    pages = [list(range(i * need, (i + 1) * need)) for i in range(n)]
    matchers = [None if g is None else Matcher(g) for g in grammars]
    stops = set(backend.info.stop_tokens)
    out: list[list[int]] = [[] for _ in grammars]
    done = [False] * n
    live, nxt, lens = list(range(n)), [list(prompt_ids) for _ in grammars], [len(prompt_ids)] * n
    mask = np.zeros((n, mask_words(backend.info.vocab_size)), dtype=np.int32)
    for step in range(max_tokens):
        constrained = [i for i in live if matchers[i] is not None]
        compiler.fill_masks([matchers[i] for i in constrained], mask)
        allowed = {i: mask[j].tobytes() for j, i in enumerate(constrained)}
        reqs = []
        for i in live:
            used, k = math.ceil(lens[i] / ps), len(nxt[i])
            sample = SamplerParams(temperature=1.0, seed=(seed + i) * 1_000_003 + step)
            reqs.append(ForwardRequest(
                pages=pages[i][:used], last_page_len=lens[i] - (used - 1) * ps, tokens=nxt[i],
                positions=list(range(lens[i] - k, lens[i])), name=f"run {i}",
                outputs=[OutputSpec(index=k - 1, sample=sample, allowed=allowed.get(i))],
            ))
        still = []
        for i, res in zip(live, backend.forward(reqs), strict=True):
            tok = res[0].token
            assert tok is not None
            m = matchers[i]
            assert m is None or m.accept(tok), f"run {i}: drawn token {tok} refused by its matcher"
            if tok in stops:
                done[i] = True
                continue
            out[i].append(tok)
            nxt[i], lens[i] = [tok], lens[i] + 1
            still.append(i)
        live = still
        if not live:
            break
    return list(zip(out, done, strict=True))


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_json_validates_against_its_schema(backend, compiler, name):
    schema = SCHEMAS[name]
    grammar = compiler.json_schema(json.dumps(schema))
    ids = prompt(backend, f"Reply with one JSON value matching this JSON schema: {json.dumps(schema)}")
    texts = []
    for i, (tokens, done) in enumerate(generate(backend, compiler, [grammar] * RUNS, ids, seed=7)):
        text = backend.tokenizer.decode(tokens)
        assert done, f"run {i} did not finish in {MAX_TOKENS} tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)
        texts.append(text)
    assert len(set(texts)) > 1  # temperature 1: the runs differ


@pytest.mark.parametrize("pattern", REGEXES)
def test_sampled_text_fullmatches_its_regex(backend, compiler, pattern):
    grammar = compiler.regex(pattern)
    ids = prompt(backend, f"Write text matching the regular expression {pattern}")
    for i, (tokens, done) in enumerate(generate(backend, compiler, [grammar] * RUNS, ids, seed=11)):
        text = backend.tokenizer.decode(tokens)
        assert done and re.fullmatch(pattern, text), f"run {i}: {text!r}"


def test_constrained_and_free_requests_in_one_batch_get_what_they_get_alone(backend, compiler):
    grammar = compiler.json_schema(json.dumps(SCHEMAS["enum and ranges"]))
    ids = prompt(backend, "Describe a T-shirt order as JSON.")
    grammars = [grammar, None, grammar]
    together = generate(backend, compiler, grammars, ids, seed=3, max_tokens=12)
    alone = [generate(backend, compiler, [g], ids, seed=3 + i, max_tokens=12)[0] for i, g in enumerate(grammars)]
    assert together == alone
    assert together[0] != together[1]


def test_a_grammar_admitting_no_token_ends_with_a_clear_error(backend, compiler):
    grammar = compiler.lark("start: NOTHING\nNOTHING: /[a-z]+/ & /[0-9]+/")  # letters and digits at once
    ids = prompt(backend, "Say something.")
    with pytest.raises(ForwardError, match="forward request 'run 1': output 0: its allowed-token mask allows "
                                           "no token") as exc:
        generate(backend, compiler, [None, grammar], ids, seed=1, max_tokens=4)
    assert exc.value.request_index == 1
