"""Context.generate through the host-side loop (forward.generate) equals the guest's own loop.

The same generation is run twice on fresh fake hosts: once as the SDK does by default (one
`forward.generate` call) and once with the stop condition wrapped so the host cannot run it (one
`decode_step` per token). Texts, streamed pieces, the context's tokens and pages, and every
forward pass the fake host saw must be the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from inferlet import Context, Sampler, send
from inferlet.generate import host_rules
from inferlet.sampler import AnyOf, MaxTokens, UntilSequence, UntilText, UntilTokens
from inferlet.testing import FakeHost


class GuestOnly:
    """A stop condition the host cannot check: forces the guest's own loop."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def check(self, generated: Sequence[int], decode: Callable[[Sequence[int]], str]) -> int | None:
        return self.inner.check(generated, decode)


def run(prepare: Callable[[Context], None], guest: bool, page_size: int = 4, num_pages: int = 64,
        **kw: Any) -> dict[str, Any]:
    host = FakeHost(page_size=page_size, num_pages=num_pages).install()
    ctx = Context()
    prepare(ctx)
    stop = kw.pop("stop", None)
    if guest:
        base = stop if stop is not None else UntilTokens(ctx.model.stop_tokens)
        stop = GuestOnly(base if kw.get("max_tokens") is None else AnyOf(MaxTokens(kw.pop("max_tokens")), base))
    text = ctx.generate(stop=stop, **kw)
    passes = [(r.pages, r.last_page_len, r.tokens, r.positions, r.mask) for r in host.forward.requests]
    return {"text": text, "sent": list(host.messaging.sent), "tokens": list(ctx.tokens), "kv_len": ctx.kv_len,
            "pages": list(ctx.pages), "passes": passes, "generate_calls": host.forward.generate_calls}


def fill(text: str) -> Callable[[Context], None]:
    return lambda ctx: ctx.fill(text)


CASES = {
    "max_tokens": (fill("hello"), {"max_tokens": 11}),
    "stop_text": (fill("abc"), {"stop": UntilText("f"), "max_tokens": 40}),
    "seeded": (fill("seed me"), {"sampler": Sampler(0.8, seed=41), "max_tokens": 9}),
    "streamed": (fill("stream"), {"max_tokens": 12, "on_text": send}),
    "chat": (lambda ctx: ctx.fill_user("hi there"), {"max_tokens": 7}),
    "after_flush": (lambda ctx: (ctx.fill("flushed first"), ctx.flush()), {"max_tokens": 6}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_loop_equals_guest_loop(case: str) -> None:
    prepare, kw = CASES[case]
    on_host = run(prepare, guest=False, **dict(kw))
    here = run(prepare, guest=True, **dict(kw))
    assert on_host["generate_calls"] == 1 and here["generate_calls"] == 0
    for key in ("text", "sent", "tokens", "kv_len", "pages", "passes"):
        assert on_host[key] == here[key], key


def test_stop_token_is_left_out_and_stays_pending() -> None:
    host = FakeHost(page_size=4).install()
    host.forward.script = [ord("o") + 3, ord("k") + 3, 2, ord("x") + 3]
    with Context() as ctx:
        ctx.fill("q")
        assert ctx.generate() == "ok"
        assert host.forward.generate_calls == 1
        assert ctx.tokens[-1] == 2 and ctx.kv_len == len(ctx.tokens) - 1


def test_out_of_pages_hands_back_and_the_sdk_goes_on_once_pages_free_up() -> None:
    host = FakeHost(page_size=4, num_pages=3).install()
    blocker = Context()
    blocker.fill("abcdefgh")
    blocker.flush()  # holds 2 of the 3 pages
    ctx = Context()
    ctx.fill("xy")
    host.kv.on_refused = blocker.release  # the next refused allocation frees the blocker's pages
    text = ctx.generate(max_tokens=6)
    assert len(text) == 6 and host.forward.generate_calls == 2  # handed back once, then finished


def test_conditions_the_host_cannot_check_stay_in_the_guest() -> None:
    assert host_rules(AnyOf(MaxTokens(3), UntilTokens([1, 2]), UntilText("x"))) == (3, [1, 2], ["x"])
    assert host_rules(UntilTokens([5])) == (None, [5], [])
    assert host_rules(AnyOf(UntilText("x"), UntilTokens([1]))) is None  # other order: other trims
    assert host_rules(UntilSequence([1, 2])) is None
    assert host_rules(GuestOnly(MaxTokens(3))) is None


def test_a_fresh_context_starts_with_generate_fresh_and_a_flushed_one_with_generate() -> None:
    host = FakeHost(page_size=4).install()
    with Context() as ctx:
        ctx.fill("longer than one page")
        prompt = list(ctx.tokens)
        ctx.generate(max_tokens=5)
        assert (host.forward.generate_fresh_calls, host.forward.generate_calls) == (1, 1)
        # the host looked the prompt up in the prefix cache once, all but its last token
        assert host.kv.prefix_lookups == [prompt[:-1]]
        assert ctx.kv_len == len(ctx.tokens) - 1 and len(ctx.pages) == -(-ctx.kv_len // 4)
    with Context() as ctx:
        ctx.fill("flushed")
        ctx.flush()
        ctx.generate(max_tokens=5)
        assert (host.forward.generate_fresh_calls, host.forward.generate_calls) == (1, 2)


def test_generate_fresh_refused_falls_back_to_waiting_for_pages() -> None:
    want = run(fill("xy"), guest=False, max_tokens=6)["text"]
    host = FakeHost(page_size=4, num_pages=3).install()
    blocker = Context()
    blocker.fill("abcdefghij")
    blocker.flush()  # holds all 3 pages
    ctx = Context()
    ctx.fill("xy")
    host.kv.on_refused = blocker.release  # generate-fresh is refused; then the blocker's pages come free
    assert ctx.generate(max_tokens=6) == want
    assert (host.forward.generate_fresh_calls, host.forward.generate_calls) == (1, 1)
