"""Images in OpenAI chat requests (issue 53) with the official `openai` client against live servers.

Fast (the stand-in backend, tests/fakes.py, behind a real `Host` and the built openai_chat handler,
served in this process): an image part reaches the model (the stand-in's "vision tower" turns an
image into 3 vectors acting as its first three bytes, and with `reads=True` the drawn token depends
on everything the prompt holds, so images of different formats give different answers), its
placeholders count in `usage.prompt_tokens`, and every bad image is a 400 naming the problem.
Slow: a tiny random LLaVA-1.5-shaped checkpoint (tests/test_backend_vision.py builds it) under a
`pie-serve` subprocess answers an image question as transformers' LlavaForConditionalGeneration does.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.server
import io
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from fakes import FakeBackend
from helpers import wasm_bytes
from PIL import Image

from host import Host, HostConfig
from host.server import Server, ServerConfig

TEXT_CHARS = len("<user>Look: ") + len("<assistant>")  # the stand-in's tokens are bytes


def _image(fmt: str, size: tuple[int, int] = (20, 14), noise: bool = False) -> bytes:
    img = Image.new("RGB", size)
    w, h = size
    if noise:
        img = Image.frombytes("RGB", size, random.Random(0).randbytes(w * h * 3))
    else:
        img.putdata([((x * 13) % 256, (y * 17) % 256, (x * y) % 256) for y in range(h) for x in range(w)])
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _user(*parts: dict[str, Any] | str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [p if isinstance(p, dict) else {"type": "text", "text": p} for p in parts]}]


def _img(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


@contextlib.contextmanager
def _serving(host: Host, data_dir: Path, **config: Any) -> Iterator[openai.OpenAI]:
    """A Server over `host` with the built openai_chat and openai_embed handlers; its openai client."""
    server = Server(host, ServerConfig(port=0, data_dir=data_dir, **config),
                    openai_program=host.compile(wasm_bytes("openai_chat")),
                    embedding_program=host.compile(wasm_bytes("openai_embed")))
    server.start_background()
    try:
        yield openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0)
    finally:
        server.stop_background()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    h = Host(HostConfig(data_dir=tmp_path_factory.mktemp("images")),
             backend=FakeBackend(page_size=4, num_pages=256, reads=True))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def client(host: Host, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    with _serving(host, tmp_path_factory.mktemp("server"), max_image_bytes=64 * 1024, max_images=3) as c:
        yield c


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model="stand-in", messages=messages, max_tokens=4,  # type: ignore[arg-type]
                                          temperature=0, **kw)


@pytest.mark.build
def test_an_image_reaches_the_model_and_counts_in_usage(client: openai.OpenAI, host: Host) -> None:
    png, gif, webp = _image("PNG"), _image("GIF"), _image("WEBP")
    answers = {}
    for name, url in (("png", _url(png)), ("gif", _url(gif, "image/gif")), ("webp", _url(webp, "image/webp")),
                      ("png again", _url(png))):
        r = _chat(client, _user("Look: ", _img(url)))
        assert r.usage is not None and r.usage.prompt_tokens == TEXT_CHARS + 3  # the image's 3 placeholders
        answers[name] = r.choices[0].message.content
    # the answer depends on the image's vectors (the stand-in: its first three bytes, whose sums differ)
    assert answers["png"] == answers["png again"]
    assert len({answers["png"], answers["gif"], answers["webp"]}) == 3
    text_only = _chat(client, [{"role": "user", "content": "Look: "}])
    assert text_only.usage is not None and text_only.usage.prompt_tokens == TEXT_CHARS
    # two images and the text between them, streamed: the same as not streamed
    msgs = _user(_img(_url(png)), "and", _img(_url(gif, "image/gif")), "?")
    whole = _chat(client, msgs)
    assert whole.usage is not None and whole.usage.prompt_tokens == len("<user>and?<assistant>") + 6
    chunks = list(_chat(client, msgs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # n > 1: the choices fork the prompt after its images ran; logprobs step token by token
    two = _chat(client, msgs, n=2)
    assert [c.message.content for c in two.choices] == [whole.choices[0].message.content] * 2
    lp = _chat(client, msgs, logprobs=True)
    assert lp.choices[0].message.content == whole.choices[0].message.content
    assert host.free_pages() == host.total_pages


@pytest.mark.build
def test_images_in_the_responses_api(client: openai.OpenAI) -> None:
    png = _image("PNG")
    r = client.responses.create(model="stand-in", max_output_tokens=4, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Look: "},
                                     {"type": "input_image", "image_url": _url(png), "detail": "auto"}]}])
    chat = _chat(client, _user("Look: ", _img(_url(png))))
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and r.usage.input_tokens == TEXT_CHARS + 3
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="stand-in", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": _url(b"not an image")}]}])
    assert e.value.body["param"] == "input" and "cannot decode" in e.value.body["message"]  # type: ignore[index]


@pytest.mark.build
def test_images_with_tool_calls_in_the_conversation(client: openai.OpenAI) -> None:
    # a past call and its result: the chat is rendered with the tools' text (render_chat), the image's
    # marker kept in it
    png = _url(_image("PNG"))
    call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    turns: list[dict[str, Any]] = [{"role": "assistant", "content": None, "tool_calls": [call]},
                                   {"role": "tool", "tool_call_id": "call_1", "content": "a cat"}]
    with_image = _chat(client, [*_user("Look: ", _img(png)), *turns])
    without = _chat(client, [*_user("Look: "), *turns])
    assert with_image.usage is not None and without.usage is not None
    assert with_image.usage.prompt_tokens == without.usage.prompt_tokens + 3


@pytest.mark.build
def test_the_context_check_counts_the_placeholders(client: openai.OpenAI) -> None:
    # the stand-in's KV cache holds 1024 tokens for one request: 1017 of text and 2 images (6) fit, 3 do not
    text, png = "x" * (1024 - 7 - TEXT_CHARS + len("Look: ")), _img(_url(_image("PNG")))
    ok = client.chat.completions.create(model="stand-in", messages=_user(text, png, png))  # type: ignore[arg-type]
    assert ok.usage is not None and ok.usage.prompt_tokens == 1023
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="stand-in", messages=_user(text, png, png, png))  # type: ignore[arg-type]
    assert e.value.code == "context_length_exceeded" and "1026 tokens in the messages" in str(e.value)


def _refused(client: openai.OpenAI, messages: list[dict[str, Any]], *needles: str) -> str:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, messages)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "messages", err
    for n in needles:
        assert n in err["message"], err["message"]
    return str(err["message"])


@pytest.mark.build
def test_bad_images_are_400s_naming_the_problem(client: openai.OpenAI, host: Host) -> None:
    png = _image("PNG")
    _refused(client, _user("x", _img(_url(b"definitely not an image"))), "message 0, image 0", "cannot decode")
    _refused(client, _user(_img(_url(png)), _img(_url(png[:80]))), "image 1", "cannot decode")  # truncated
    big = _image("PNG", (160, 160), noise=True)
    assert len(big) > 64 * 1024
    _refused(client, _user(_img(_url(big))), f"over the server's bound of {64 * 1024}", "--max-image-mb")
    _refused(client, _user(*[_img(_url(png))] * 4), "4 images, more than the 3", "--max-images")
    _refused(client, _user(_img(_url(_image("BMP"), "image/bmp"))), "unsupported image media type 'image/bmp'")
    _refused(client, _user(_img("data:image/png;base64,@@@@")), "base64 does not decode")
    _refused(client, _user(_img("data:image/png," + "x" * 10)), "must be base64")
    _refused(client, _user(_img("ftp://example.com/cat.png")), "must be a data: URL")
    _refused(client, _user(_img("https://example.com/cat.png")), "does not fetch image URLs", "--allow-remote-images")
    _refused(client, [{"role": "system", "content": [_img(_url(png))]}, *_user("hi")],
             "only user messages may carry images")
    _refused(client, _user({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
             "content parts must be text (or image_url")
    assert host.instances() == []  # each was refused before anything was launched


@pytest.mark.build
def test_a_large_image_crosses_into_the_host(host: Host, tmp_path: Path) -> None:
    # a 6 MB PNG reaches the vision tower (embed-image takes base64: a list<u8> of megabytes would not
    # cross into the host); over --max-image-mb it is a 400 naming the flag
    def png_of(size: int) -> bytes:  # uncompressed noise: its PNG is about its pixels' bytes
        w = int(((size - 1000) / 3) ** 0.5)
        buf = io.BytesIO()
        Image.frombytes("RGB", (w, w), random.Random(1).randbytes(w * w * 3)).save(buf, "PNG", compress_level=0)
        return buf.getvalue()

    big = png_of(6_000_000)
    with _serving(host, tmp_path, max_image_bytes=16 * 2**20, max_body_bytes=64 * 2**20) as c:
        r = _chat(c, _user("Look: ", _img(_url(big))))
        assert r.usage is not None and r.usage.prompt_tokens == TEXT_CHARS + 3
    with _serving(host, tmp_path / "small", max_image_bytes=5 * 2**20, max_body_bytes=64 * 2**20) as c:
        _refused(c, _user(_img(_url(big))), "--max-image-mb")


class _Images(http.server.BaseHTTPRequestHandler):
    """Serves /cat.png (a PNG), /big.png (too large), /missing (404), /redirect (to /cat.png)."""

    png = _image("PNG")

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        body = {"/cat.png": self.png, "/big.png": b"\x89PNG" + b"\0" * 200_000}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body or b"")))
        self.end_headers()
        self.wfile.write(body or b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_site() -> Iterator[str]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.mark.build
def test_remote_images_only_where_allowed(host: Host, tmp_path: Path, image_site: str,
                                          client: openai.OpenAI) -> None:
    inline = _chat(client, _user("Look: ", _img(_url(_Images.png))))
    # allowed from the test's own address (named explicitly: an IP pattern allows whatever kind it is)
    with _serving(host, tmp_path / "a", allow_remote_images=("127.0.0.1",), max_image_bytes=64 * 1024) as c:
        for path in ("/cat.png", "/redirect"):
            r = _chat(c, _user("Look: ", _img(image_site + path)))
            assert r.choices[0].message.content == inline.choices[0].message.content
            assert r.usage is not None and r.usage.prompt_tokens == TEXT_CHARS + 3
        _refused(c, _user(_img(image_site + "/missing")), "answered HTTP 404")
        _refused(c, _user(_img(image_site + "/big.png")), "--max-image-mb")
    # "*" (--allow-remote-images alone): global addresses only, never loopback or private ones
    with _serving(host, tmp_path / "b", allow_remote_images=("*",)) as c:
        _refused(c, _user(_img(image_site + "/cat.png")), "cannot fetch", "blocked", "loopback")
        _refused(c, _user(_img("http://10.1.2.3/cat.png")), "blocked", "private")
        _refused(c, _user(_img("http://169.254.169.254/latest")), "blocked", "metadata")


@pytest.mark.build
def test_a_text_only_model_takes_no_images(tmp_path: Path) -> None:
    backend = FakeBackend(page_size=4, num_pages=64)
    backend.info = dataclasses.replace(backend.info, image_tokens=0, image_token_id=None)
    with Host(HostConfig(data_dir=tmp_path / "h"), backend=backend) as h, _serving(h, tmp_path / "s") as c:
        _refused(c, _user("What is this?", _img(_url(_image("PNG")))), "takes no images", "no vision tower")
        assert _chat(c, [{"role": "user", "content": "text is fine"}]).choices[0].finish_reason in ("stop", "length")


# ---- a vision-language model under pie-serve, against transformers ------------------------------

TEMPLATE = "{% for m in messages %}USER: {{ m['content'] }} ASSISTANT:{% endfor %}"


@pytest.mark.build
@pytest.mark.slow
def test_llava_answers_as_transformers_does(tmp_path: Path) -> None:
    import torch
    import transformers
    from test_backend_vision import IMAGE_TOKEN, make_llava
    from test_openai_e2e import serving

    path = tmp_path / "llava"
    model = make_llava(path, "llava15", processor=dict(size={"shortest_edge": 36}, crop_size=32))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    png, question = _image("PNG", (45, 33)), "\nWhat is in the picture?"
    messages = [{"role": "user", "content": [_img(_url(png)), {"type": "text", "text": question}]}]
    with contextlib.contextmanager(serving)(tmp_path / "data", "--model", str(path), "--warm-start", "none",
                                            "--num-pages", "64", "--page-size", "4") as served:
        client = served.client()
        r = client.chat.completions.create(model=served.model, messages=messages,  # type: ignore[arg-type]
                                           max_tokens=8, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=served.model, messages=messages, max_tokens=8, temperature=0, stream=True)  # type: ignore[arg-type]
            if c.choices)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    n_img = 16  # (32 / 8) ** 2 patches, the CLS dropped
    ids = enc("USER: ") + [IMAGE_TOKEN] * n_img + enc(question + " ASSISTANT:")
    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=Image.open(io.BytesIO(png)), return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        gen = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=8, do_sample=False,
                             pad_token_id=257, eos_token_id=257)[0, len(ids):].tolist()
    want = gen[: gen.index(257)] if 257 in gen else gen
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)  # the image's 16 placeholders included
    assert r.usage.completion_tokens == len(gen)
    # (random weights draw random bytes: the text leaves out a last, incomplete UTF-8 character, which
    # transformers' decode shows as U+FFFD)
    text, theirs = r.choices[0].message.content or "", tok.decode(want)
    assert text == streamed and theirs.startswith(text) and set(theirs[len(text):]) <= {"\ufffd"}
    assert len(text) >= len(theirs) - 1
    assert r.choices[0].finish_reason == ("stop" if 257 in gen else "length")


def test_pie_serve_flags() -> None:
    from host.cli.serve import parse_args, server_config_from_args

    default = server_config_from_args(parse_args([]))
    assert (default.max_image_bytes, default.max_images, default.allow_remote_images) == (20 * 2**20, 8, ())
    cfg = server_config_from_args(parse_args(["--max-image-mb", "1.5", "--max-images", "2", "--allow-remote-images"]))
    assert (cfg.max_image_bytes, cfg.max_images, cfg.allow_remote_images) == (3 * 2**20 // 2, 2, ("*",))
    cfg = server_config_from_args(parse_args(["--allow-remote-images", "images.example.com", "10.0.0.0/8"]))
    assert cfg.allow_remote_images == ("images.example.com", "10.0.0.0/8")
    with pytest.raises(ValueError, match="expected HOST"):
        server_config_from_args(parse_args(["--allow-remote-images", "http://x/"]))
    with pytest.raises(ValueError, match="max_images must be > 0"):
        server_config_from_args(parse_args(["--max-images", "0"]))
    assert parse_args([]).embedding_handler == "openai_embed"
    assert default.matryoshka is None
    assert server_config_from_args(parse_args(["--matryoshka"])).matryoshka == ()
    assert server_config_from_args(parse_args(["--matryoshka", "64", "128"])).matryoshka == (64, 128)
    with pytest.raises(ValueError, match="matryoshka widths must be > 0"):
        server_config_from_args(parse_args(["--matryoshka", "0"]))
