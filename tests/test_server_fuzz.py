"""Random msgpack frames and random JSON bodies against a live server (issue 37): each is answered
(a response, an HTTP status below 500, or a close with a protocol code and reason), no answer
carries an internal error or a traceback, and a well-behaved client keeps being served throughout.
The example count comes from PIE_FUZZ_EXAMPLES (40 by default, more in `make test`)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_support import WASM, FakeHost, running_server
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from host.client import PieClient
from host.client.protocol import pack

EXAMPLES = int(os.environ.get("PIE_FUZZ_EXAMPLES", "40"))
PROTOCOL_CLOSE_CODES = {1003, 1007, 1008, 1009}
TYPES = ["authenticate", "ping", "query", "upload_program", "launch_instance", "signal_instance", "close_input",
         "terminate_instance", "attach_instance", "bogus"]
FIELDS = ["corr_id", "token", "subject", "record", "program_hash", "chunk_index", "total_chunks", "chunk_data",
          "arguments", "detached", "instance_id", "message"]

# Text with the odd cases in it: lone surrogates (packed as the invalid UTF-8 they encode to), NUL, emoji.
TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
SCALARS = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
           | TEXT | st.binary(max_size=64))
MSGPACK_VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                              | st.dictionaries(TEXT | st.sampled_from(FIELDS), kids, max_size=4), max_leaves=12)
WASM_HASH = hashlib.sha256(WASM).hexdigest()  # uploaded by the fixture: launches of it run the fake's scripts
REQUESTS = st.fixed_dictionaries(
    {"type": st.sampled_from(TYPES)},
    optional={f: (st.integers(-5, 2**64 - 1) if f in ("corr_id", "chunk_index", "total_chunks") else MSGPACK_VALUES)
              for f in FIELDS} | {
        "subject": st.sampled_from(["program_exists", "models", "instances", "stats", "x"]),
        "program_hash": st.just(WASM_HASH) | MSGPACK_VALUES,
        "arguments": st.lists(st.sampled_from(["echo", "chat", "hold", "crash", "oom", "flood", "3", "x"]), max_size=4)
        | MSGPACK_VALUES,
    },
)


def _pack(value: Any) -> bytes:
    """msgpack, lone surrogates included (as bytes that are not UTF-8: what a hostile client may send)."""
    return msgpack.packb(value, use_bin_type=True, unicode_errors="surrogatepass")


FRAMES = (REQUESTS.map(_pack) | MSGPACK_VALUES.map(_pack) | st.binary(max_size=200)
          | st.builds(lambda n: b"\x91" * n + b"\xc0", st.integers(1, 3000)))  # deeply nested arrays

JSON_SCALARS = (st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats(allow_nan=False)
                | st.text(st.characters(codec=None), max_size=30))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=12), kids, max_size=4), max_leaves=12)
OPENAI_PARAMS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
                 "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options", "logprobs", "top_logprobs",
                 "response_format"]
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                           "content": JSON_VALUES}), max_size=3)
BODIES = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries({"model": st.just("fake-model"), "messages": MESSAGES},
                          optional={k: JSON_VALUES for k in OPENAI_PARAMS[2:]}),
    st.fixed_dictionaries({"model": st.just("fake-model"), "prompt": JSON_VALUES},
                          optional={k: JSON_VALUES for k in OPENAI_PARAMS[3:]}),
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    host = FakeHost(total_pages=1 << 20)
    with running_server(tmp_path_factory.mktemp("fuzz"), host=host, openai=True) as srv:
        async def upload() -> None:
            async with await PieClient.connect(srv.url) as client:
                assert await client.upload_program(WASM) == WASM_HASH
        asyncio.run(upload())
        yield srv


async def _answer(url: str, frame: bytes) -> list[dict[str, Any]]:
    """Send `frame`, then a ping; the responses up to the ping's (or the close, as a dict)."""
    got: list[dict[str, Any]] = []
    async with connect(url, max_size=None) as ws:
        await ws.send(frame)
        try:
            await ws.send(pack({"type": "ping", "corr_id": -424242}))
            while True:
                msg = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10), raw=False)
                got.append(msg)
                if msg.get("corr_id") == -424242:
                    return got
        except ConnectionClosed as closed:
            assert closed.rcvd is not None, "closed without a close frame"
            got.append({"closed": closed.rcvd.code, "reason": closed.rcvd.reason})
            return got


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(frame=FRAMES)
def test_random_frames_are_answered_and_others_keep_being_served(served, frame: bytes) -> None:
    async def main() -> None:
        async with await PieClient.connect(served.url) as bystander:
            got = await _answer(served.url, frame)
            last = got[-1]
            if "closed" in last:
                assert last["closed"] in PROTOCOL_CLOSE_CODES and last["reason"], last
            else:
                assert last["successful"] and last["result"] == "pong"
            for msg in got:
                text = repr(msg)
                assert "internal server error" not in text and "Traceback" not in text, msg
            assert await bystander.ping() >= 0

    asyncio.run(main())


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=BODIES, chat=st.booleans(), as_text=st.booleans())
def test_random_json_bodies_are_answered_below_500(served, body: Any, chat: bool, as_text: bool) -> None:
    import json

    raw = json.dumps(body, ensure_ascii=as_text).encode("utf-8", "surrogatepass")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(f"{served.http_url}{path}", content=raw, timeout=30)
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in r.text
    assert httpx.get(f"{served.http_url}/health").status_code == 200
