"""inferlet.warmup: the build-time warm-up runs `main` against its own stand-in host, never the real one."""

from __future__ import annotations

from types import ModuleType

import inferlet
import pytest
from helpers import load_app
from inferlet import _host
from inferlet.model import _MODEL
from inferlet.pages import PAGES
from inferlet.testing import FakeHost
from inferlet.warmup import warm_up

INTERFACES = ("model", "kv", "forward", "runtime", "messaging", "store", "grammar")  # listed here, not taken from _host


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(page_size=4, num_pages=64).install()


def _text_completion() -> ModuleType:
    return load_app("text_completion", "tc_warm")  # the module warms itself up at import


def _untouched(host: FakeHost) -> None:
    assert host.forward.requests == [] and not host.kv.held and host.messaging.sent == []


def test_text_completion_warms_up_without_calling_the_host(host: FakeHost) -> None:
    bound = {name: getattr(_host, name) for name in INTERFACES}
    app = _text_completion()
    _untouched(host)
    # every run of the plain path completes on the stand-in (a new host call in that path fails this)
    assert warm_up(app.main, [], ["-p", "Hi", "--max-tokens", "4"], ["-p", "x", "--raw", "--stream"]) == 6
    _untouched(host)
    assert {name: getattr(_host, name) for name in INTERFACES} == bound
    assert PAGES.refs == {} and _MODEL._page_size is None and _MODEL._stop is None  # facts come from the real host
    host.forward.script = [b + 3 for b in b"Paris."] + [2]
    assert app.main(["--prompt", "capital?"]) == "Paris."
    assert host.kv.free_pages() == 64


def test_a_run_that_fails_is_not_counted_and_the_host_comes_back(host: FakeHost) -> None:
    bound = {name: getattr(_host, name) for name in INTERFACES}

    def needs_the_store(args: list[str]) -> str | None:
        return inferlet.store_get("k")  # no stand-in: raises inside the run

    def raises(args: list[str]) -> str | None:
        raise ValueError(args)

    def streams_itself(args: list[str]) -> str | None:
        inferlet.send("a piece")  # the stand-in takes it: not sent to anyone
        return None

    assert warm_up(needs_the_store, []) == 0
    assert warm_up(streams_itself, []) == 2 and host.messaging.sent == []
    assert warm_up(raises, ["a"], rounds=3) == 0
    assert {name: getattr(_host, name) for name in INTERFACES} == bound
    assert host.store.data == {}


def test_openai_chat_warms_up_with_the_servers_request_shape(host: FakeHost) -> None:
    import json
    from dataclasses import fields

    from host.server.openai_request import SERVER_ONLY_FIELDS, OpenAIRequest

    app = load_app("openai_chat", "oc_warm")
    _untouched(host)
    for arg in app.WARM_UP_REQUESTS:  # what the server would send: every field of its request
        assert set(json.loads(arg)) == {f.name for f in fields(OpenAIRequest)} - set(SERVER_ONLY_FIELDS)
    assert warm_up(app.main, *([r] for r in app.WARM_UP_REQUESTS)) == 2 * len(app.WARM_UP_REQUESTS)
    _untouched(host)
