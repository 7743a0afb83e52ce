"""Embeddings (WIT 0.5.0, interface `embed`): images and text as vectors, and sequences as one vector.

    from inferlet import Context, Sampler, embed

    with Context() as ctx:                      # image question answering (a vision-language model)
        ctx.fill("USER: ")
        ctx.fill_image(png_bytes, "image/png")  # the image's vectors, on placeholder tokens
        ctx.fill("\\nWhat is in the picture? ASSISTANT:")
        answer = ctx.generate(Sampler.greedy(), max_tokens=32)

    vec = embed.embed_tokens(get_model().encode("a document"))    # one normalized vector (last token)

A `Slot` holds vectors in host memory (counted against the instance's limit): release it when done;
`Context.fill_image` releases its slot once the image has run. Needs a host serving WIT 0.5.0.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping, Sequence

from inferlet import _host

__all__ = ["EmbedError", "Slot", "embed_image", "embed_text", "embed_tokens", "hidden_size", "image_token_id",
           "image_tokens"]


class EmbedError(Exception):
    """The host did not embed: the model has no vision tower, the image does not decode or is too
    large, or the instance holds its maximum of slots."""


class Slot:
    """Vectors in host memory: `len(slot)` of them, fed to a pass with `Context.fill_slot`."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self._len: int | None = None

    def __len__(self) -> int:
        if self._len is None:
            self._len = int(_host.embed.slot_len(self.handle))
        return self._len

    def release(self) -> None:
        _host.embed.release([self.handle])


def hidden_size() -> int:
    return int(_host.embed.hidden_size())


def image_tokens() -> int:
    """Vectors (placeholder tokens) one image takes; 0 for a model without a vision tower."""
    return int(_host.embed.image_tokens())


def image_token_id() -> int | None:
    """The placeholder token an image stands on (the model's own image token), or None."""
    return _host.embed.image_token_id()


def embed_image(image: bytes, media_type: str = "") -> Slot:
    """An image through the model's vision tower into a new slot (EmbedError if it cannot)."""
    try:  # (in base64: a string crosses into the host in one copy, a list of megabytes of u8 does not)
        return Slot(_host.embed.embed_image(base64.b64encode(bytes(image)).decode("ascii"), media_type))
    except _host.Err as e:
        raise EmbedError(str(e.value)) from None


def embed_text(tokens: Sequence[int]) -> Slot:
    """The model's input embeddings of `tokens` into a new slot."""
    try:
        return Slot(_host.embed.embed_text(list(tokens)))
    except _host.Err as e:
        raise EmbedError(str(e.value)) from None


def embed_tokens(tokens: Sequence[int], pooling: str = "last", normalize: bool = True,
                 slots: Mapping[int, Slot] | None = None) -> list[float]:
    """One vector for a token sequence: its hidden states (after the model's final norm), the last
    token's or their mean, L2-normalized by default (as embedding models such as Qwen3-Embedding).
    `slots` puts a slot's vectors at `tokens[index:index + len(slot)]` (the ids there are
    placeholders: an image's embedding, say). Runs one pass over fresh pages, released before returning."""
    from inferlet.pages import PAGES

    ids = list(tokens)
    if not ids:
        raise ValueError("embed_tokens of no tokens")
    ps = int(_host.kv.page_size())
    pages = PAGES.allocate(-(-len(ids) // ps))
    try:
        embeds = [(int(i), s.handle) for i, s in (slots or {}).items()]
        return list(_host.embed.hidden(pages, len(ids) - (len(pages) - 1) * ps, ids, list(range(len(ids))), embeds,
                                       _pooling(pooling), normalize))
    finally:
        PAGES.release(pages)


def _pooling(name: str) -> object:
    if name not in ("last", "mean"):
        raise ValueError(f"pooling must be 'last' or 'mean', got {name!r}")
    enum = getattr(_host.embed, "Pooling", None)  # (componentize-py's enum class; the fake host takes the name)
    return name if enum is None else getattr(enum, name.upper())
