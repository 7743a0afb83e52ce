"""`POST /v1/embeddings` (issue 53) with the official `openai` client against live servers.

Fast: the stand-in backend (tests/fakes.py; its hidden state of a token is [token, position, sum of
the tokens up to it, 1]) behind a real `Host` and the built openai_embed handler, served in this
process: the vectors, their order, `usage`, base64 = float, `dimensions`, and each bad request a
400 naming the problem. Slow: `pie-serve` on the default model (SmolLM2-135M), its vectors equal to
transformers' `AutoModel` last hidden state of the last token, L2-normalized.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from fakes import FakeBackend
from helpers import wasm_bytes

from host import Host, HostConfig
from host.server import Server, ServerConfig

pytestmark = pytest.mark.build

MODEL = "stand-in"


@contextlib.contextmanager
def _serving(host: Host, data_dir: Path, embeddings: bool = True, **config: Any) -> Iterator[tuple[openai.OpenAI, str]]:
    server = Server(host, ServerConfig(port=0, data_dir=data_dir, **config),
                    openai_program=host.compile(wasm_bytes("openai_chat")),
                    embedding_program=host.compile(wasm_bytes("openai_embed")) if embeddings else None)
    server.start_background()
    try:
        yield openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0), server.http_url
    finally:
        server.stop_background()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    backend = FakeBackend(page_size=4, num_pages=64)
    backend.info = dataclasses.replace(backend.info, matryoshka=[])  # a Matryoshka model: any width
    h = Host(HostConfig(data_dir=tmp_path_factory.mktemp("embed")), backend=backend)
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def served(host: Host, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[openai.OpenAI, str]]:
    with _serving(host, tmp_path_factory.mktemp("server")) as s:
        yield s


def _want(text: str, dims: int | None = None) -> np.ndarray:
    """The stand-in's normalized last-token hidden state of `text` (its bytes are its tokens)."""
    ids = list(text.encode())
    v = np.asarray([ids[-1], len(ids) - 1, sum(ids), 1.0])[:dims]
    return v / np.linalg.norm(v)


def test_vectors_order_and_usage(served: tuple[openai.OpenAI, str], host: Host) -> None:
    client, _ = served
    r = client.embeddings.create(model=MODEL, input=["xyz", "ab", "hello"], encoding_format="float")
    assert [d.index for d in r.data] == [0, 1, 2] and r.object == "list" and r.model == MODEL
    for d, text in zip(r.data, ["xyz", "ab", "hello"], strict=True):
        assert d.object == "embedding" and len(d.embedding) == 4
        np.testing.assert_allclose(d.embedding, _want(text), rtol=1e-6)
    assert (r.usage.prompt_tokens, r.usage.total_tokens) == (10, 10)
    one = client.embeddings.create(model=MODEL, input="xyz", encoding_format="float")
    assert len(one.data) == 1 and one.data[0].embedding == r.data[0].embedding and one.usage.prompt_tokens == 3
    # token ids: one array, or an array of arrays
    ids = client.embeddings.create(model=MODEL, input=list(b"xyz"), encoding_format="float")
    many = client.embeddings.create(model=MODEL, input=[list(b"xyz"), list(b"ab")], encoding_format="float")
    assert ids.data[0].embedding == r.data[0].embedding
    assert [d.embedding for d in many.data] == [d.embedding for d in r.data[:2]] and many.usage.prompt_tokens == 5
    assert host.free_pages() == host.total_pages


def test_base64_equals_float_and_dimensions(served: tuple[openai.OpenAI, str]) -> None:
    client, url = served
    floats = client.embeddings.create(model=MODEL, input=["xyz", "ab"], encoding_format="float")
    # the client's default: it asks for base64 and decodes it itself
    default = client.embeddings.create(model=MODEL, input=["xyz", "ab"])
    assert [d.embedding for d in default.data] == [d.embedding for d in floats.data]
    raw = client.embeddings.create(model=MODEL, input=["xyz", "ab"], encoding_format="base64")
    for d, f in zip(raw.data, floats.data, strict=True):
        assert isinstance(d.embedding, str)
        assert np.frombuffer(base64.b64decode(d.embedding), dtype="<f4").tolist() == f.embedding
    # without encoding_format (plain HTTP): floats
    body = httpx.post(f"{url}/v1/embeddings", json={"model": MODEL, "input": "xyz"}).json()
    assert body["data"][0]["embedding"] == floats.data[0].embedding and body["usage"]["total_tokens"] == 3
    # dimensions: the first N values, normalized again
    short = client.embeddings.create(model=MODEL, input=["xyz", "ab"], dimensions=2, encoding_format="float")
    for d, text in zip(short.data, ["xyz", "ab"], strict=True):
        assert len(d.embedding) == 2
        np.testing.assert_allclose(d.embedding, _want(text, 2), rtol=1e-6)
    full = client.embeddings.create(model=MODEL, input="xyz", dimensions=4, encoding_format="float")
    assert full.data[0].embedding == floats.data[0].embedding


def _refused(client: openai.OpenAI, param: str, *needles: str, **kw: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(**{"model": MODEL, "encoding_format": "float", **kw})
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == param, err
    for n in needles:
        assert n in err["message"], err["message"]


def test_bad_requests_are_400s_naming_the_problem(served: tuple[openai.OpenAI, str], host: Host) -> None:
    client, url = served
    _refused(client, "input", "non-empty", input=[])
    _refused(client, "input", "input 1 is an empty string", input=["a", ""])
    _refused(client, "input", "input 0 is an empty array of token ids", input=[[]])
    _refused(client, "input", "token id 300 is outside the vocabulary (size 256)", input=[[1, 300]])
    _refused(client, "input", "token id -1 is outside the vocabulary", input=[-1, 2])
    _refused(client, "input", "2049 inputs, more than the 2048", input=["a"] * 2049)
    _refused(client, "input", "all strings or all token-id arrays", input=["a", [1, 2]])
    # the stand-in's KV cache (64 pages of 4) holds 256 tokens for one request
    _refused(client, "input", "input 0 is 300 tokens, more than the 256", input=["x" * 300])
    _refused(client, "dimensions", "5 is more than the model's 4 dimensions", input="xyz", dimensions=5)
    _refused(client, "dimensions", "positive integer", input="xyz", dimensions=0)
    _refused(client, "encoding_format", "float or base64", input="xyz", encoding_format="int8")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="other", input="xyz")
    r = httpx.post(f"{url}/v1/embeddings", content=b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert host.instances() == []  # each was refused before anything was launched


def test_a_model_without_hidden_states_and_a_server_without_the_handler(tmp_path: Path) -> None:
    backend = FakeBackend(page_size=4, num_pages=64)
    backend.info = dataclasses.replace(backend.info, hidden_size=0)
    with Host(HostConfig(data_dir=tmp_path / "h"), backend=backend) as h:
        with _serving(h, tmp_path / "s") as (client, _):
            _refused(client, "model", "gives no embeddings", input="xyz")
    with Host(HostConfig(data_dir=tmp_path / "h2"), backend=FakeBackend(page_size=4, num_pages=64)) as h:
        with _serving(h, tmp_path / "s2", embeddings=False) as (client, _):
            _refused(client, "model", "serves no embeddings", "--embedding-handler none", input="xyz")


def test_dimensions_only_where_the_model_allows_it(tmp_path: Path) -> None:
    # a model whose config declares no Matryoshka representation: its full width only, unless the
    # operator says otherwise (pie-serve --matryoshka); declared widths: those only
    with Host(HostConfig(data_dir=tmp_path / "h"), backend=FakeBackend(page_size=4, num_pages=64)) as h:
        assert h.backend.info.matryoshka is None
        with _serving(h, tmp_path / "s") as (client, _):
            _refused(client, "dimensions", "does not allow dimensions=2", "--matryoshka", input="xyz", dimensions=2)
            full = client.embeddings.create(model=MODEL, input="xyz", dimensions=4, encoding_format="float")
            np.testing.assert_allclose(full.data[0].embedding, _want("xyz"), rtol=1e-6)
        with _serving(h, tmp_path / "s2", matryoshka=(2,)) as (client, _):
            two = client.embeddings.create(model=MODEL, input="xyz", dimensions=2, encoding_format="float")
            np.testing.assert_allclose(two.data[0].embedding, _want("xyz", 2), rtol=1e-6)
            _refused(client, "dimensions", "allows dimensions 2 or 4, not 3", input="xyz", dimensions=3)
    backend = FakeBackend(page_size=4, num_pages=64)
    backend.info = dataclasses.replace(backend.info, matryoshka=[1, 3])  # as config.json's matryoshka_dimensions
    with Host(HostConfig(data_dir=tmp_path / "h2"), backend=backend) as h, _serving(h, tmp_path / "s3") as (client, _):
        three = client.embeddings.create(model=MODEL, input="ab", dimensions=3, encoding_format="float")
        np.testing.assert_allclose(three.data[0].embedding, _want("ab", 3), rtol=1e-6)
        _refused(client, "dimensions", "allows dimensions 1, 3 or 4, not 2", input="ab", dimensions=2)


# ---- the default model under pie-serve, against transformers ------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from test_openai_e2e import serving

    # (--matryoshka: SmolLM2 was not trained for it, but the test truncates as the flag allows)
    yield from serving(tmp_path_factory.mktemp("embed-e2e"), "--warm-start", "none", "--num-pages", "256",
                       "--matryoshka")


@pytest.mark.slow
def test_default_model_vectors_match_transformers(real: Any) -> None:
    import torch
    import transformers
    from helpers import hf_default_tokenizer

    from gpu_backend.loading.loader import default_model_path

    client = real.client()
    texts = ["The capital of France is Paris.", "Bananas are yellow", "a"]
    floats = client.embeddings.create(model=real.model, input=texts, encoding_format="float")
    path = default_model_path()
    model = transformers.AutoModel.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tok = hf_default_tokenizer()
    tokens = 0
    for d, text in zip(floats.data, texts, strict=True):
        ids = tok(text)["input_ids"]
        tokens += len(ids)
        with torch.inference_mode():
            h = model(torch.tensor([ids])).last_hidden_state[0, -1]
        want = (h / h.norm()).numpy()
        got = np.asarray(d.embedding)
        assert got.shape == (576,)
        assert float(np.abs(got - want).max()) < 1e-4, text
        assert abs(float(np.linalg.norm(got)) - 1) < 1e-5
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    # base64 (the client's default, decoded by it) is the same float32 values
    b64 = client.embeddings.create(model=real.model, input=texts)
    assert [d.embedding for d in b64.data] == [d.embedding for d in floats.data]
    # token ids give the same vectors; dimensions truncate and renormalize
    ids_r = client.embeddings.create(model=real.model, input=[tok(t)["input_ids"] for t in texts], encoding_format="float")
    assert [d.embedding for d in ids_r.data] == [d.embedding for d in floats.data]
    short = client.embeddings.create(model=real.model, input=texts[0], dimensions=64, encoding_format="float")
    head = np.asarray(floats.data[0].embedding[:64])
    np.testing.assert_allclose(short.data[0].embedding, head / np.linalg.norm(head), rtol=1e-5, atol=1e-7)
    with pytest.raises(openai.BadRequestError, match="577 is more than the model's 576 dimensions"):
        client.embeddings.create(model=real.model, input="x", dimensions=577)
    # the default model is text-only: an image is refused, naming why
    png = base64.b64encode(bytes.fromhex("89504e470d0a1a0a")).decode()
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        client.chat.completions.create(model=real.model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}]}])
