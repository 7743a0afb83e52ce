"""WIT 0.5.0 `embed` through the host on the stand-in backend (whose "vision tower" turns an image
into 3 vectors acting as the tokens of its first three bytes, and whose hidden state is [token,
position, sum of the tokens attended to, 1]: gpu_backend/standin.py): slots, passes with vectors,
hidden-state passes and pooling, the prefix cache never reusing image pages; workers too."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
from fakes import FakeBackend
from helpers import run_to_end, wasm_bytes

from host import Host, HostConfig

pytestmark = pytest.mark.build


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    h = Host(HostConfig(data_dir=tmp_path_factory.mktemp("embed")), backend=FakeBackend(page_size=4, num_pages=64))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def prog(host: Host) -> str:
    return host.compile(wasm_bytes("embedder"))


def _run(host: Host, prog: str, *args: str) -> str:
    end = run_to_end(host, prog, list(args))
    assert end.event == "completed", end
    return end.message


def test_facts(host: Host, prog: str) -> None:
    assert json.loads(_run(host, prog, "facts")) == [4, 3, 250]


def test_an_images_vectors_reach_the_pass(host: Host, prog: str) -> None:
    got = json.loads(_run(host, prog, "image", "050607ff"))
    # "ab" (97, 98), the image as tokens 5, 6, 7, "cd" (99, 100): the last token's hidden state
    assert got == {"hidden": [100.0, 6.0, 97 + 98 + 5 + 6 + 7 + 99 + 100, 1.0], "tokens": 7}
    other = json.loads(_run(host, prog, "image", "0a0b0c"))
    assert other["hidden"][2] == 97 + 98 + 10 + 11 + 12 + 99 + 100  # another image, the same placeholders


def test_a_context_generates_after_an_image_and_images_are_never_cached(host: Host, prog: str) -> None:
    # the stand-in draws last + 1; what matters: it runs, and a second image of the same placeholders
    # is not answered from the first's pages (their sums would match)
    assert json.loads(_run(host, prog, "generate", "01020304")) == ["d", "e", "f"]
    a = json.loads(_run(host, prog, "image", "101112"))["hidden"][2]
    b = json.loads(_run(host, prog, "image", "202122"))["hidden"][2]
    assert b - a == 3 * 0x10


@pytest.mark.parametrize(("pooling", "normalize"), [("last", "0"), ("mean", "0"), ("last", "1"), ("mean", "1")])
def test_pooled_vectors(host: Host, prog: str, pooling: str, normalize: str) -> None:
    got = np.asarray(json.loads(_run(host, prog, "vector", "xyz", pooling, normalize)))
    rows = np.asarray([[120, 0, 120, 1], [121, 1, 241, 1], [122, 2, 363, 1]], dtype=float)  # x, y, z
    want = rows[-1] if pooling == "last" else rows.mean(0)
    if normalize == "1":
        want = want / np.linalg.norm(want)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_slots_and_their_misuse(host: Host, prog: str) -> None:
    assert _run(host, prog, "slots") == "3"
    trap = run_to_end(host, prog, ["release-twice"])
    assert trap.event == "exception" and "unknown embedding slot" in trap.message
