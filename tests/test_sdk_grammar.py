"""SDK structured generation on the fake host: `Context.generate(grammar=...)` on both loops, the
helpers (`json_schema`, `regex`, `choice`), `Matcher`, errors, and pie-run's file arguments."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from inferlet import Context, GrammarError, Matcher, Sampler, choice, json_schema, regex
from inferlet.testing import FakeHost

from host.cli.file_args import expand_file_arguments

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["n", "ok"],
          "additionalProperties": False}


def generate(grammar, here: bool, **kw) -> tuple[str, FakeHost, Context]:  # noqa: ANN001
    host = FakeHost(page_size=4, num_pages=64).install()
    ctx = Context()
    ctx.fill_user("hi")
    on_text = (lambda _t: None) if here else None  # a callback: the guest's own loop
    text = ctx.generate(Sampler(temperature=1.0, seed=3), max_tokens=kw.pop("max_tokens", 40), on_text=on_text,
                        grammar=grammar, **kw)
    return text, host, ctx


@pytest.mark.parametrize("here", [False, True])
def test_json_schema_output_validates_on_both_loops(here: bool) -> None:
    text, host, _ctx = generate(json_schema(SCHEMA), here)
    obj = json.loads(text)
    assert set(obj) == {"n", "ok"} and 0 <= obj["n"] <= 99 and isinstance(obj["ok"], bool)
    assert (host.forward.generate_calls, host.forward.decode_step_calls > 0) == ((0, True) if here else (1, False))


def test_both_loops_give_the_same_tokens() -> None:
    (a, _h1, c1), (b, _h2, c2) = generate(regex("[a-z]{2,5}-[0-9]{2}"), False), generate(regex("[a-z]{2,5}-[0-9]{2}"), True)
    assert a == b and c1.tokens == c2.tokens and re.fullmatch("[a-z]{2,5}-[0-9]{2}", a)


def test_choice_returns_one_option_and_json_schema_none_is_any_object() -> None:
    text, _h, _c = generate(choice(["yes", "no", "maybe (?)"]), False)
    assert text in ("yes", "no", "maybe (?)")
    text, _h, _c = generate(json_schema(), False, max_tokens=200)
    assert isinstance(json.loads(text), dict)
    with pytest.raises(ValueError, match="non-empty"):
        choice([])


def test_a_matcher_goes_on_where_it_stands() -> None:
    FakeHost().install()
    m = regex("ab(c|d)").matcher()
    assert m.accept(Context().model.encode("ab")) == 2 and isinstance(m, Matcher)
    ctx = Context()
    ctx.fill_user("x")
    assert ctx.generate(max_tokens=5, grammar=m) in ("c", "d") and m.is_terminated()
    twin = m.fork()
    m.rollback(2)
    assert (m.accepted, twin.accepted, twin.is_terminated()) == (2, 4, True)


def test_bad_grammars_raise_grammar_error_naming_the_problem() -> None:
    FakeHost().install()
    with pytest.raises(GrammarError, match="invalid JSON schema"):
        json_schema({"type": "nonsense"}).compiled()
    with pytest.raises(GrammarError, match="invalid regex"):
        regex("(").matcher()


@pytest.mark.parametrize("here", [False, True])
def test_a_grammar_admitting_no_token_raises_and_leaves_the_context_as_it_was(here: bool) -> None:
    from inferlet import lark

    host = FakeHost().install()
    ctx = Context()
    ctx.fill_user("hi")
    before = (list(ctx.tokens), ctx.kv_len, list(ctx.pages))
    with pytest.raises(GrammarError, match="admits no token"):
        ctx.generate(max_tokens=4, grammar=lark("start: N\nN: /[a-z]+/ & /[0-9]+/"),
                     on_text=(lambda _t: None) if here else None)
    assert (ctx.tokens, ctx.kv_len, ctx.pages) == before
    assert host.kv.held == set()


def test_pie_run_reads_declared_file_arguments(tmp_path: Path) -> None:
    f = tmp_path / "s.json"
    f.write_text('{"type": "object"}')
    assert expand_file_arguments("constrained_json", ["--schema", str(f), "-n", "5"]) == \
        ["--schema", '{"type": "object"}', "-n", "5"]
    assert expand_file_arguments("constrained_json", [f"--schema={f}"]) == ["--schema", '{"type": "object"}']
    assert expand_file_arguments("text_completion", ["--schema", str(f)]) == ["--schema", str(f)]
    with pytest.raises(ValueError, match="--schema nope.json: cannot read the file"):
        expand_file_arguments("constrained_json", ["--schema", "nope.json"])


def test_submit_decode_with_a_matcher_equals_decode_step_with_it() -> None:
    def steps(submit: bool) -> list[int]:
        FakeHost().install()
        ctx = Context()
        ctx.fill_user("hi")
        m = regex("[xyz]{3}").matcher()
        out = []
        for _ in range(4):
            out.append(ctx.submit_decode(matcher=m).wait() if submit else ctx.decode_step(matcher=m))
        assert m.is_terminated()
        return out

    assert steps(True) == steps(False)
