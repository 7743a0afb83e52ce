"""The example inferlets of WIT 0.5.0 `embed` end to end, against transformers on the same weights:
`image_qa` on a tiny random LLaVA-1.5-shaped checkpoint (its answer = LlavaForConditionalGeneration's
greedy tokens on the same prompt and image) and `retrieval` on the default model (its scores = the
cosine of transformers' normalized last-token hidden states)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch
from helpers import Run, run_to_end, wasm_bytes
from PIL import Image

from host import Host, HostConfig

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.build

TEMPLATE = "{% for m in messages %}USER: {{ m['content'] }} ASSISTANT:{% endfor %}"


def _png() -> bytes:
    img = Image.new("RGB", (45, 33))
    img.putdata([((x * 5) % 256, (y * 7) % 256, (x * y) % 256) for y in range(33) for x in range(45)])
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def test_image_qa_answers_as_transformers_does(tmp_path: Path) -> None:
    from test_backend_vision import IMAGE_TOKEN, make_llava

    path = tmp_path / "llava"
    model = make_llava(path, "llava15", processor=dict(size={"shortest_edge": 36}, crop_size=32))
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    data = _png()
    with Host(HostConfig(model=str(path), data_dir=tmp_path / "data")) as h:
        n_img = h.services.info.image_tokens  # type: ignore[attr-defined]
        tok = h.services.tokenizer
        end = run_to_end(h, h.compile(wasm_bytes("image_qa")),
                         ["--image", base64.b64encode(data).decode(), "--question", "What is it?", "-n", "6",
                          "--json"])
        assert end.event == "completed", end.message
        got = json.loads(end.message)
    ids = tok.encode("USER: ") + [IMAGE_TOKEN] * n_img + tok.encode("\nWhat is it? ASSISTANT:")
    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        gen = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=6, do_sample=False,
                             pad_token_id=257, eos_token_id=257)[0, len(ids):].tolist()
    want = tok.decode([t for t in gen if t != 257]).strip()
    assert got == {"answer": want, "image_tokens": n_img}


def test_image_qa_refuses_bad_images_and_text_models(tmp_path: Path) -> None:
    from fakes import FakeBackend

    with Host(HostConfig(data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=64)) as h:
        prog = h.compile(wasm_bytes("image_qa"))
        end = run_to_end(h, prog, ["--image", "not base64!"])
        assert end.event == "exception" and "--image must be base64" in end.message
        end = run_to_end(h, prog, ["--image", base64.b64encode(b"x").decode()])  # the stand-in needs 3 bytes
        assert end.event == "exception" and "the image: the image does not decode" in end.message


@pytest.mark.slow
def test_retrieval_ranks_as_transformers_hidden_states(real_host: Host) -> None:
    from gpu_backend.loading.loader import default_model_path

    docs = ["Paris is the capital and largest city of France.", "Bananas are yellow.", "The moon orbits the Earth."]
    question = "What is the capital of France?"
    r = Run(real_host, real_host.compile(wasm_bytes("retrieval")),
            ["--question", question, "--json", "-n", "8", *[a for d in docs for a in ("--doc", d)]])
    end = r.finish(180)
    assert end.event == "completed", end.message
    ranking = json.loads(end.message)["ranking"]
    path = default_model_path()
    model = transformers.AutoModel.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    tok = real_host.services.tokenizer

    def vec(text: str) -> torch.Tensor:
        with torch.inference_mode():
            h = model(torch.tensor([tok.encode(text)])).last_hidden_state[0, -1]
        return h / h.norm()

    q = vec(question)
    want = sorted(((float(vec(d) @ q), d) for d in docs), key=lambda s: -s[0])
    assert [x["doc"] for x in ranking] == [d for _s, d in want]
    for x, (s, _d) in zip(ranking, want, strict=True):
        assert abs(x["score"] - s) < 1e-3
    end = run_to_end(real_host, real_host.compile(wasm_bytes("image_qa")), ["--image", base64.b64encode(b"png").decode()])
    assert end.event == "exception" and "has no vision tower" in end.message


def test_retrieval_answers_from_the_nearest_document(tmp_path: Path) -> None:
    # the stand-in (tests/fakes.py): a token is a byte, the last-token hidden state of ids is [last,
    # position, sum, 1] (so the ranking is known without the code under test), and with reads=True a
    # drawn token depends on every token the prompt holds: the answer tells which document was in it
    import numpy as np
    from fakes import FakeBackend

    docs, question = ["zebra stripes", "apples", "a cat sat on a mat"], "what sat?"

    def vec(text: str) -> np.ndarray:
        ids = list(text.encode())
        v = np.asarray([ids[-1], len(ids) - 1, sum(ids), 1.0])
        return v / np.linalg.norm(v)

    scores = {d: float(vec(d) @ vec(question)) for d in docs}
    want = sorted(docs, key=lambda d: -scores[d])
    assert len(set(scores.values())) == 3
    with Host(HostConfig(data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=256, reads=True)) as h:
        prog = h.compile(wasm_bytes("retrieval"))

        def ask(*given: str) -> dict:
            end = run_to_end(h, prog, ["--question", question, "--json", "-n", "4",
                                       *[a for d in given for a in ("--doc", d)]])
            assert end.event == "completed", end.message
            return json.loads(end.message)

        got = ask(*docs)
        assert [x["doc"] for x in got["ranking"]] == want
        for x in got["ranking"]:
            assert abs(x["score"] - scores[x["doc"]]) < 1e-5
        alone = {d: ask(d)["answer"] for d in docs}
        assert len(set(alone.values())) == 3  # the answer does tell the documents apart
        assert got["answer"] == alone[want[0]]
