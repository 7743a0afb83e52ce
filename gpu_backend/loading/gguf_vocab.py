"""A GGUF file's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama,
Phi-3, Gemma) as a tokenizer.json, built the way transformers builds its tokenizer from the same file.

A GGUF stores the pieces, their scores and types, not merges: the merges are recovered from the
vocabulary (every split of a piece into two pieces, best score first, as transformers'
`generate_merges`). The BPE has byte fallback; a space prefix comes from a Metaspace pre-tokenizer
(Phi-3: a Prepend/Replace normalizer) and is stripped again on decode; control tokens are special
added tokens, user-defined ones plain added tokens, both matched whole in text.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["gemma_pieces", "sentencepiece_json"]

CONTROL, USER_DEFINED = 3, 4  # llama.cpp token types


def _merges(tokens: list[str], scores: list[float]) -> list[list[str]]:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for piece, score in dict(zip(tokens, scores, strict=True)).items():
        local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [[left, right] for left, right, _ in merges]


def _added(tokens: list[str], types: list[int]) -> list[dict[str, Any]]:
    return [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": k == CONTROL}
            for i, (t, k) in enumerate(zip(tokens, types, strict=True)) if k in (CONTROL, USER_DEFINED)]


def gemma_pieces(tokens: list[str]) -> tuple[list[str], list[float]]:
    """Gemma files spell a piece of spaces with real spaces, and their scores do not follow the merge
    order: the pieces respelled with "▁", and their order in the file as scores (as transformers does)."""
    return ([("\u2581" * len(t)) if " " in t and not t.strip() else t for t in tokens],
            [-float(i) for i in range(len(tokens))])


def sentencepiece_json(arch: str, tokens: list[str], scores: list[float], types: list[int],
                       add_space_prefix: bool = True) -> str:
    """tokenizer.json text for a GGUF SentencePiece vocabulary of architecture `arch` (Gemma's pieces
    respelled first: `gemma_pieces`)."""
    if arch.startswith("gemma"):  # no space prefix; the normalizer writes spaces as "▁"
        return _json(tokens, scores, types, {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
                     {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious",
                      "invert": False}, [], "<unk>")
    strip = [{"type": "Strip", "content": " ", "start": 1, "stop": 0}] if add_space_prefix else []
    normalizer: dict[str, Any] | None = None
    pre: dict[str, Any] | None = {"type": "Metaspace", "replacement": "\u2581", "split": False,
                                  "prepend_scheme": "first" if add_space_prefix else "never"}
    if arch == "phi3":  # Phi-3's own tokenizer.json prefixes the space with a normalizer
        normalizer = {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
        pre = None
    return _json(tokens, scores, types, normalizer, pre, strip, None)


def _json(tokens: list[str], scores: list[float], types: list[int], normalizer: dict[str, Any] | None,
          pre: dict[str, Any] | None, strip: list[dict[str, Any]], unk: str | None) -> str:
    decoder = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"}, *strip]}
    model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
             "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
             "vocab": {t: i for i, t in enumerate(tokens)}, "merges": _merges(tokens, scores)}
    return json.dumps({"version": "1.0", "truncation": None, "padding": None,
                       "added_tokens": _added(tokens, types), "normalizer": normalizer, "pre_tokenizer": pre,
                       "post_processor": None, "decoder": decoder, "model": model})
