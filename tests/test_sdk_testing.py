"""`inferlet.testing.TinyBackend`: the SDK test host's model implements the one `Backend` protocol."""

from __future__ import annotations

import pytest
from inferlet.testing import FakeHost, FakeTrap, TinyBackend

from gpu_backend.types import (
    Backend,
    BackendInfo,
    ForwardError,
    ForwardRequest,
    OutputSpec,
    SamplerParams,
    Tokenizer,
)

GREEDY = SamplerParams()


def expected_token(pairs: list[tuple[int, int]]) -> int:
    """The documented rule, written out again: fold the attended (token, position) pairs."""
    acc = 7
    for tok, pos in pairs:
        acc = (acc * 31 + 7 * tok + pos) % 1_000_003
    return 3 + 97 + acc % 26  # the byte "a" + acc % 26, offset by the three specials


def test_tiny_backend_implements_the_protocol() -> None:
    b = TinyBackend(page_size=4, num_pages=8)
    assert isinstance(b, Backend) and isinstance(b.info, BackendInfo) and isinstance(b.tokenizer, Tokenizer)
    assert (b.info.page_size, b.info.num_pages) == (4, 8)
    chat = b.tokenizer.apply_chat_template([{"role": "user", "content": "hé"}])
    assert b.tokenizer.decode(b.tokenizer.encode(chat)) == chat == "<s>user\nhé<|im_end|>\n<s>assistant\n"


def test_tiny_backend_forward_follows_the_rule_across_pages_and_masks() -> None:
    b = TinyBackend(page_size=4, num_pages=8)
    b.erase([5, 2])
    prompt = [(40, 10), (41, 11), (42, 12), (43, 13), (44, 14), (45, 15)]  # pages 5 then 2
    first = ForwardRequest(pages=[5, 2], last_page_len=2, tokens=[t for t, _ in prompt],
                           positions=[p for _, p in prompt],
                           outputs=[OutputSpec(index=5, sample=GREEDY), OutputSpec(index=2, dist=3)])  # fmt: skip
    (out,) = b.forward([first])
    assert out[0].token == expected_token(prompt) and out[0].ids == []
    row2 = expected_token(prompt[:3])
    assert out[1].token is None and out[1].ids == [row2, row2 + 1, row2 + 2]
    assert b.slots[5] == prompt[:4] and b.slots[2][:2] == prompt[4:]

    # One more token, with context tokens 1..3 masked: BRLE [attend 1, masked 3, attend 3].
    nxt = ForwardRequest(pages=[5, 2], last_page_len=3, tokens=[46], positions=[16], mask=[[1, 3, 3]],
                         outputs=[OutputSpec(index=0, sample=GREEDY)])  # fmt: skip
    (out,) = b.forward([nxt])
    assert out[0].token == expected_token([prompt[0], prompt[4], prompt[5], (46, 16)])


def test_tiny_backend_rejects_unwritten_context_and_copies_slots() -> None:
    b = TinyBackend(page_size=4, num_pages=8)
    b.erase([1, 3])
    read_unwritten = ForwardRequest(pages=[1], last_page_len=3, tokens=[50], positions=[2])
    with pytest.raises(ForwardError, match="slot 0 of the sequence was never written") as err:
        b.forward([ForwardRequest(pages=[3], last_page_len=1, tokens=[9], positions=[0]), read_unwritten])
    assert err.value.request_index == 1 and b.slots[3] == [None] * 4  # nothing written on failure
    b.forward([ForwardRequest(pages=[1], last_page_len=2, tokens=[20, 21], positions=[0, 1])])
    b.copy_tokens(1, 0, 3, 1, 2)
    assert b.slots[3] == [None, (20, 0), (21, 1), None]


def test_fake_host_runs_passes_through_its_backend() -> None:
    backend = TinyBackend(page_size=4, num_pages=16)
    host = FakeHost(backend=backend).install()
    (page,) = host.kv.allocate(1)
    out = host.forward.run([page], 2, [60, 61], [0, 1], [], [host.forward.OutputSpec(1, None, 2)])
    want = expected_token([(60, 0), (61, 1)])
    assert out[0].token is None and out[0].ids == [want, want + 1]
    assert host.kv.slots is backend.slots and host.kv.slots[page][:2] == [(60, 0), (61, 1)]
    with pytest.raises(FakeTrap, match=r"forward: .*token 999 out of range"):
        host.forward.run([page], 3, [999], [2], [], [])  # the shared validator's check


def test_set_priority_through_the_fake_host() -> None:
    import inferlet

    host = FakeHost().install()
    assert inferlet.priority() == 0
    inferlet.set_priority(7)
    assert inferlet.priority() == 7 and host.runtime.priorities == [7]
    with pytest.raises(FakeTrap, match=r"^runtime\.set-priority: priority must be from -1000 to 1000 .*got 1001$"):
        inferlet.set_priority(1001)
    assert inferlet.priority() == 7


def test_fake_host_http_answers_through_the_sdk() -> None:
    import json

    from inferlet import http
    from inferlet.testing import FakeHost
    from inferlet.testing.http import FakeHttpError

    def handler(method: str, url: str, headers: list[tuple[str, str]], body: bytes):
        if url.endswith("/private"):
            raise FakeHttpError("blocked: 10.0.0.1 is a private address")
        return 200, [("Content-Type", "application/json")], json.dumps({"echo": f"{method} {body.decode()}"}).encode()

    host = FakeHost(http=handler).install()
    r = http.post_json("https://api.test/x", {"a": 1})
    assert r.ok and r.header("content-type") == "application/json" and r.json() == {"echo": 'POST {"a": 1}'}
    assert host.http.requests[-1].headers[0] == ("content-type", "application/json")
    with pytest.raises(http.HttpError) as e:
        http.get("https://api.test/private")
    assert e.value.kind == "blocked"
    FakeHost().install()
    with pytest.raises(http.HttpError, match="--http-allow"):
        http.get("https://api.test/x")


def test_fake_host_embed_through_the_sdk() -> None:
    """inferlet.embed and Context.fill_image on the fake host: an image's vectors act as its bytes'
    tokens, so the context continues as if those tokens had been filled."""
    from inferlet import Context, Sampler, embed
    from inferlet.testing import FakeHost

    host = FakeHost(image_tokens=2).install()
    assert (embed.hidden_size(), embed.image_tokens(), embed.image_token_id()) == (4, 2, host.backend.info.vocab_size - 1)
    with Context() as a, Context() as b:
        a.fill("ab")
        a.fill_image(bytes(a.model.encode("cd")))  # (the fake image: its bytes act as tokens)
        a.fill("e")
        b.fill("abcde")
        assert [a.decode_step(Sampler.greedy()) for _ in range(4)] == [b.decode_step(Sampler.greedy()) for _ in range(4)]
    assert host.embed.slots == {}  # the image's slot was released once it ran
    assert embed.embed_tokens([5, 6], "mean", False) == [5.5, 0.5, 8.0, 1.0]
    # a slot's vectors in place of placeholders act as their tokens (the fake: a vector is its token)
    slot = embed.embed_text([6, 7])
    assert embed.embed_tokens([5, 0, 0, 8], "last", False, slots={1: slot}) == [8.0, 3.0, 26.0, 1.0]
    slot.release()
    FakeHost().install()
    with pytest.raises(embed.EmbedError, match="no vision tower"):
        embed.embed_image(b"xx")


def test_fake_host_chat_with_an_image_part() -> None:
    from inferlet import Context, Sampler
    from inferlet.testing import FakeHost

    FakeHost(image_tokens=2).install()
    with Context() as a, Context() as b:
        img = bytes(a.model.encode("XY"))  # (the fake image acts as these tokens)
        a.fill_chat([{"role": "user", "content": [{"type": "text", "text": "look: "}, {"type": "image", "image": img},
                                                  {"type": "text", "text": " what?"}]}])
        b.fill_chat([{"role": "user", "content": "look: XY what?"}])
        assert a.generate(Sampler.greedy(), max_tokens=5) == b.generate(Sampler.greedy(), max_tokens=5)
