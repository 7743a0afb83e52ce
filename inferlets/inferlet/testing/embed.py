"""The fake host's `embed` interface (WIT 0.5.0), over the fake `forward`.

Vectors are 4 wide. `embed-text` gives [token, 0, 0, 0] per token, and a pass that takes vectors
runs the token each vector's first value rounds to (so a slot of embed-text vectors behaves as its
tokens); `embed-image` (only with `FakeHost(image_tokens=N)`) gives N vectors acting as the image's
first N bytes. A hidden state is [token, position, sum of the pass's tokens up to it, 1], pooled and
normalized as asked: enough to test an inferlet's plumbing, not a model.
"""

from __future__ import annotations

import base64
from typing import Any

from inferlet._host import Err
from inferlet.testing.records import trap

__all__ = ["FakeEmbed"]

WIDTH = 4


class FakeEmbed:
    def __init__(self, forward: Any, vocab_size: int, image_tokens: int = 0) -> None:
        self.forward, self.vocab_size, self._image_tokens = forward, vocab_size, image_tokens
        self.slots: dict[int, list[list[float]]] = {}
        self._next = 0

    def hidden_size(self) -> int:
        return WIDTH

    def image_tokens(self) -> int:
        return self._image_tokens

    def image_token_id(self) -> int | None:
        return (self.vocab_size - 1) if self._image_tokens else None

    def embed_image(self, image_b64: str, media_type: str) -> int:
        image = base64.b64decode(image_b64)
        if not self._image_tokens:
            raise Err("this model has no vision tower: it takes no images")
        if len(image) < self._image_tokens:
            raise Err("the image does not decode")
        return self._add([[float(b % self.vocab_size), 0.0, 0.0, 0.0] for b in image[: self._image_tokens]])

    def embed_text(self, tokens: list[int]) -> int:
        if not tokens:
            raise trap("embed.embed-text", "embed-text of no tokens")
        for t in tokens:
            if not 0 <= t < self.vocab_size:
                raise trap("embed.embed-text", f"token {t} is outside the vocabulary (size {self.vocab_size})")
        return self._add([[float(t), 0.0, 0.0, 0.0] for t in tokens])

    def slot_len(self, slot: int) -> int:
        return len(self._get(slot, "embed.slot-len"))

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self._get(s, "embed.release")
        for s in slots:
            del self.slots[s]

    def run(self, pages, last_page_len, tokens, positions, embeds, outputs):  # noqa: ANN001, ANN201
        return self.forward.run(pages, last_page_len, self._tokens(tokens, embeds), positions, [], outputs)

    def hidden(self, pages, last_page_len, tokens, positions, embeds, pooling, normalize):  # noqa: ANN001, ANN201
        ids = self._tokens(tokens, embeds)
        self.forward.run(pages, last_page_len, ids, positions, [], [])  # (its K/V written, as the host's)
        rows, seen = [], 0.0
        for t, p in zip(ids, positions, strict=True):
            seen += t
            rows.append([float(t), float(p), seen, 1.0])
        mode = getattr(pooling, "name", pooling)
        v = rows[-1] if str(mode).lower() == "last" else [sum(c) / len(rows) for c in zip(*rows, strict=True)]
        if normalize:
            n = sum(x * x for x in v) ** 0.5
            v = [x / n for x in v] if n else v
        return v

    def _tokens(self, tokens: list[int], embeds: list[tuple[int, int]]) -> list[int]:
        out = list(tokens)
        for index, slot in embeds:
            vecs = self._get(slot, "embed.run")
            if index + len(vecs) > len(out):
                raise trap("embed.run", f"embedding slot {slot} at token {index} passes the pass's {len(out)} tokens")
            for k, v in enumerate(vecs):
                out[index + k] = int(round(v[0])) % self.vocab_size
        return out

    def _add(self, vecs: list[list[float]]) -> int:
        self._next += 1
        self.slots[self._next] = vecs
        return self._next

    def _get(self, slot: int, call: str) -> list[list[float]]:
        if slot not in self.slots:
            raise trap(call, f"unknown embedding slot {slot} (never made by this instance, or released)")
        return self.slots[slot]
