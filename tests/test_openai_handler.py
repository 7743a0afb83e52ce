"""The openai_chat handler inferlet on the SDK's fake host (issue 14), no model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from inferlet.testing import FakeHost

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(page_size=4, num_pages=64).install()


def _app() -> ModuleType:
    spec = importlib.util.spec_from_file_location("oc_app", ROOT / "inferlets" / "openai_chat" / "app.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
