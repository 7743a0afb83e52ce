"""The openai_chat handler inferlet on the SDK's fake host (issue 14), no model."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest
from helpers import load_app
from inferlet.testing import FakeHost


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(page_size=4, num_pages=64).install()


def _app() -> ModuleType:
    return load_app("openai_chat", "oc_app")


def _bytes(text: str) -> list[int]:
    return [b + 3 for b in text.encode()]


def _run(host: FakeHost, **req: Any) -> list[dict[str, Any]]:
    body = {"prompt": "hi", "max_tokens": 20, "temperature": 0.0, **req}
    _app().main([json.dumps(body)])
    return [json.loads(m) for m in host.messaging.sent]


def test_stop_string_cut_across_tokens_and_streamed_without_it(host: FakeHost) -> None:
    host.forward.script = _bytes("Paris END more") + [2]
    msgs = _run(host, stop=["END"], stream=True)
    deltas = "".join(m["delta"] for m in msgs if "delta" in m)
    final = next(m for m in msgs if "text" in m)
    assert final["text"] == "Paris " and deltas == "Paris " and final["finish_reason"] == "stop"
    assert msgs[-1]["usage"]["prompt_tokens"] > 0 and not host.kv.held


def test_length_finish_reason(host: FakeHost) -> None:
    host.forward.script = _bytes("abcdefgh") + [2]
    final = next(m for m in _run(host, max_tokens=3) if "text" in m)
    assert final["finish_reason"] == "length" and final["completion_tokens"] == 3


def test_n_choices_and_pages_released(host: FakeHost) -> None:
    host.forward.script = (_bytes("ab") + [2]) * 2
    msgs = _run(host, n=2)
    assert [m["index"] for m in msgs if "text" in m] == [0, 1] and not host.kv.held


def test_logprobs_entries_one_per_token_in_the_text(host: FakeHost) -> None:
    import math

    host.forward.script = _bytes("abcENDxyz") + [2]
    msgs = _run(host, logprobs=True, top_logprobs=2, stop=["END"])
    final = next(m for m in msgs if "text" in m)
    assert final["text"] == "abc" and final["finish_reason"] == "stop"
    entries = final["logprobs"]
    assert [e["token"] for e in entries] == ["a", "b", "c"]  # the stop string's tokens left out
    assert [e["text_offset"] for e in entries] == [0, 1, 2]
    # the stand-in's distribution: the drawn token first with p = 0.5, then 0.25, ...
    assert all(math.isclose(e["logprob"], math.log(0.5)) for e in entries)
    assert [len(e["top_logprobs"]) for e in entries] == [2, 2, 2]
    top = entries[0]["top_logprobs"]
    assert top[0] == {"token": "a", "logprob": entries[0]["logprob"], "bytes": [97]}
    assert math.isclose(top[1]["logprob"], math.log(0.25)) and top[1]["token"] == "b"
    assert entries[1]["bytes"] == [98] and not host.kv.held


def test_logprobs_stream_deltas_carry_their_entries(host: FakeHost) -> None:
    host.forward.script = _bytes("Paris END more") + [2]
    msgs = _run(host, logprobs=True, stream=True, stop=["END"])
    deltas = [m for m in msgs if "delta" in m]
    assert "".join(m["delta"] for m in deltas) == "Paris "
    streamed = [e["token"] for m in deltas for e in m["logprobs"]]
    assert "".join(streamed) == "Paris " and all(not e["top_logprobs"] for m in deltas for e in m["logprobs"])


def test_logprobs_and_plain_paths_draw_the_same_tokens(host: FakeHost) -> None:
    host.forward.script = _bytes("same text") + [2]
    plain = next(m for m in _run(host) if "text" in m)
    host.messaging.sent.clear()
    host.forward.script = _bytes("same text") + [2]
    with_lp = next(m for m in _run(host, logprobs=True) if "text" in m)
    assert plain["text"] == with_lp["text"] == "same text"
    assert plain["completion_tokens"] == with_lp["completion_tokens"]
