"""SDK pieces without KV logic: BRLE, samplers and stop conditions, streaming, the export glue."""

from __future__ import annotations

import dataclasses
import sys
from types import ModuleType

import inferlet
import pytest
from helpers import load_app
from inferlet import (
    AnyOf,
    Context,
    MaxTokens,
    Sampler,
    UntilSequence,
    UntilText,
    UntilTokens,
    _host,
)
from inferlet.entry import make_world
from inferlet.mask import brle, masked_full_pages, pass_rows
from inferlet.testing import FakeHost


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(page_size=4, num_pages=64).install()


def byte_tokens(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


# ---- BRLE ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "runs"),
    [([], [0]), ([False] * 3, [3]), ([True, True], [0, 2]), ([False, True, True, False], [1, 2, 1])],
)
def test_brle(flags: list[bool], runs: list[int]) -> None:
    assert brle(flags) == runs


def test_pass_rows_cover_context_plus_prefix_and_attend_self() -> None:
    rows = pass_rows([False, True], [True, False, False])
    assert rows == [[1, 1, 1], [1, 2, 1], [1, 2, 2]]
    for i, row in enumerate(rows):
        assert sum(row) == 2 + i + 1
        assert len(row) % 2 == 1  # ends with an attend run: the token itself


def test_masked_full_pages_skips_partly_masked_and_partial_pages() -> None:
    flags = [True] * 4 + [True, False, True, True] + [True] * 4 + [True] * 3  # the last page is partial
    assert masked_full_pages(flags, 4) == {0, 2}
    assert masked_full_pages([], 4) == set()


# ---- samplers and stops ----------------------------------------------------------------------


def test_sampler_validation_and_wit_record(host: FakeHost) -> None:
    with pytest.raises(ValueError, match="top_p"):
        Sampler(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        Sampler(temperature=-1)
    rec = Sampler(0.7, 40, 0.9, 0.05, seed=-1).to_wit()
    assert (rec.temperature, rec.top_k, rec.top_p, rec.min_p) == pytest.approx((0.7, 40, 0.9, 0.05))
    assert rec.seed == (1 << 64) - 1  # u64
    assert Sampler.greedy() == Sampler() and Sampler().to_wit().seed is None


def test_stop_conditions() -> None:
    def dec(ids: list[int]) -> str:
        return bytes(t - 3 for t in ids).decode(errors="replace")

    assert MaxTokens(2).check([5], dec) is None and MaxTokens(2).check([5, 6], dec) == 0
    assert UntilTokens([9]).check([5, 9], dec) == 1 and UntilTokens([9]).check([9, 5], dec) is None
    assert (
        UntilSequence([7, 8]).check([1, 7, 8], dec) == 2
        and UntilSequence([7, 8]).check([7, 8, 1], dec) is None
    )
    assert UntilText("END").check(byte_tokens("x" * 50 + "EN"), dec) is None
    assert UntilText("END").check(byte_tokens("x" * 50 + "END"), dec) == 0
    assert AnyOf(MaxTokens(10), UntilTokens([9])).check([9], dec) == 1


def test_seeded_generation_varies_seed_per_step(host: FakeHost) -> None:
    with Context() as ctx:
        ctx.fill("ab")
        ctx.generate(Sampler(temperature=1.0, seed=10), max_tokens=3)
    seeds = [r.outputs[0].sample.seed for r in host.forward.requests if r.outputs]
    assert seeds == [10, 11, 12]


def test_generate_trims_sequence_stop(host: FakeHost) -> None:
    host.forward.script = byte_tokens("hi###more")
    with Context() as ctx:
        ctx.fill("q")
        assert ctx.generate(stop=UntilSequence(byte_tokens("###"))) == "hi"


# ---- streaming ------------------------------------------------------------------------------


def test_streaming_emits_whole_characters(host: FakeHost) -> None:
    text = "é€😀 ok"
    host.forward.script = byte_tokens(text) + [2]
    chunks: list[str] = []
    with Context() as ctx:
        ctx.fill("q")
        out = ctx.generate(on_text=chunks.append)
    assert out == text and "".join(chunks) == text
    assert all("\ufffd" not in c for c in chunks)
    assert chunks[:3] == ["é", "€", "😀"]  # a 4-byte character arrives once, whole


def test_streaming_respects_trimmed_stop_token(host: FakeHost) -> None:
    host.forward.script = byte_tokens("ab") + [2]
    chunks: list[str] = []
    with Context() as ctx:
        ctx.fill("q")
        ctx.generate(on_text=chunks.append)
    assert chunks == ["a", "b"]  # "<|im_end|>" is never streamed


# ---- runtime wrappers and model --------------------------------------------------------------


def test_runtime_wrappers(host: FakeHost) -> None:
    host.runtime.args = ["--x", "1"]
    host.messaging.inbox.append("hello")
    assert inferlet.args() == ["--x", "1"] and inferlet.receive(10) == "hello" and inferlet.receive() is None
    inferlet.send("out")
    inferlet.subscribe("t")
    inferlet.publish("t", "m")
    assert host.messaging.sent == ["out"] and inferlet.receive_published() == ("t", "m")
    inferlet.store_set("k", "v")
    assert inferlet.store_get("k") == "v" and inferlet.store_exists("k") and inferlet.store_keys() == ["k"]
    inferlet.store_delete("k")
    assert inferlet.store_get("k") is None


def test_model_wrappers(host: FakeHost) -> None:
    m = inferlet.get_model()
    assert m.page_size == 4 and m.stop_tokens == (1, 2) and m.name == "fake"
    assert m.decode(m.encode("héllo<|im_end|>")) == "héllo<|im_end|>"
    assert m.apply_chat_template([("user", "hi")]) == "<s>user\nhi<|im_end|>\n<s>assistant\n"
    with pytest.raises(ValueError, match="role"):
        m.apply_chat_template([{"content": "x"}])
    with pytest.raises(inferlet.ModelError, match="available: fake"):
        inferlet.get_model("nope")


def test_unbound_host_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not _host.IN_GUEST  # plain CPython: no componentize-py bindings
    monkeypatch.setattr(_host, "runtime", _host._Unbound("runtime"))
    with pytest.raises(RuntimeError, match="FakeHost"):
        inferlet.args()


# ---- the export glue and text_completion -------------------------------------------------------


def _world(source: str) -> object:
    mod = type(sys)("user_app")
    exec(source, mod.__dict__)
    return make_world(mod)()


def test_run_sets_return_value(host: FakeHost) -> None:
    host.runtime.args = ["a", "b"]
    _world("def main(args):\n    return '|'.join(args)").run()
    assert host.runtime.returned == "a|b"


def test_run_turns_exceptions_into_err_with_traceback(host: FakeHost) -> None:
    with pytest.raises(_host.Err) as err:
        _world("def main(args):\n    return 1 / 0").run()
    assert "ZeroDivisionError" in err.value.value and "Traceback" in err.value.value
    with pytest.raises(_host.Err, match="must return str"):
        _world("def main(args):\n    return 5").run()
    with pytest.raises(_host.Err) as err:
        _world("import sys\ndef main(args):\n    sys.exit(3)").run()
    assert "SystemExit" in err.value.value
    with pytest.raises(TypeError, match="must define"):
        _world("x = 1")


def _text_completion() -> ModuleType:
    return load_app("text_completion", "tc_app")


def test_text_completion_uses_chat_template_and_stops(host: FakeHost) -> None:
    app = _text_completion()
    host.forward.script = byte_tokens("Paris.") + [2]
    assert app.main(["--prompt", "capital?"]) == "Paris."
    prompt = host.model.apply_chat_template([host.model.Message("user", "capital?")], True)
    first = host.forward.requests[0]  # prefill and the first sample in one pass
    assert first.tokens == host.model.encode(prompt) and not host.kv.held
    assert [o.index for o in first.outputs] == [len(first.tokens) - 1]
    assert len(host.forward.requests) == len(byte_tokens("Paris.")) + 1  # one pass per sampled token


def test_text_completion_raw_max_tokens_and_stream(host: FakeHost) -> None:
    app = _text_completion()
    out = app.main(["-p", "abc", "--raw", "--max-tokens", "5", "--stream"])
    assert len(out) == 5 and "".join(host.messaging.sent) == out
    assert host.forward.requests[0].tokens == byte_tokens("abc")  # the raw prompt, prefilled with the first sample


def test_text_completion_raw_adds_bos_where_the_tokenizer_does(host: FakeHost) -> None:
    app = _text_completion()
    host.backend.tokenizer.add_bos = True  # a tokenizer whose post-processor prepends <s> (id 0)
    app.main(["-p", "abc", "--raw", "--max-tokens", "1"])
    assert host.forward.requests[0].tokens == [0, *byte_tokens("abc")]
    with inferlet.Context() as ctx:
        ctx.fill("x")
        with pytest.raises(ValueError, match="starts a context"):
            ctx.fill_prompt("y")  # BOS only at the start


def test_text_completion_without_a_chat_template_says_to_use_raw(host: FakeHost) -> None:
    app = _text_completion()
    host.backend.info = dataclasses.replace(host.backend.info, chat_template="")
    with pytest.raises(inferlet.InferletError, match="has no chat template.*use --raw"):
        app.main(["-p", "abc"])
    assert not host.forward.requests
    assert app.main(["-p", "abc", "--raw", "--max-tokens", "2"])  # and --raw completes it


def test_text_completion_default_prompt(host: FakeHost) -> None:
    app = _text_completion()
    app.main(["--max-tokens", "2"])
    toks, want = list(host.forward.requests[0].tokens), byte_tokens("What is the capital of France?")
    assert any(toks[i : i + len(want)] == want for i in range(len(toks)))


def test_text_completion_bad_arguments(host: FakeHost) -> None:
    app = _text_completion()
    with pytest.raises(inferlet.InferletError, match="unrecognized arguments: --bogus"):
        app.main(["-p", "x", "--bogus"])
    with pytest.raises(inferlet.InferletError, match="--prompt must not be empty"):
        app.main(["--prompt", ""])
    with pytest.raises(inferlet.InferletError, match="invalid float value"):
        app.main(["-p", "x", "--temperature", "hot"])
    # -h/--help: the help text becomes the instance's return value, through the export glue
    host.runtime.args = ["-p", "x", "--help"]
    make_world(app)().run()
    assert "usage: text_completion" in (host.runtime.returned or "")
