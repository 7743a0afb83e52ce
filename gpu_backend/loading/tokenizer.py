"""The model's tokenizer: byte-level BPE on tiktoken, SentencePiece-style BPE on the `tokenizers`
library (the one transformers runs), plus the model's chat template rendered with jinja2.

Both decode as transformers does (special and added tokens as their text, ids the vocabulary does
not define as nothing): byte-level ids by joining their bytes (`token_bytes`), SentencePiece-style
ones through the tokenizer.json's decoder. Both hold back a character whose bytes are not all there.
"""

from __future__ import annotations

import json
import re
import unicodedata
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import tiktoken
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpu_backend.loading.model_files import TokenizerSpec


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    # GPT-2's reversible byte -> printable unicode mapping, inverted.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _token_bytes(tok: str) -> bytes | None:
    table = _unicode_to_byte()
    try:
        return bytes(table[ch] for ch in tok)
    except KeyError:
        return None  # not a byte-level token (e.g. a non-special added token written in plain text)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(piece: str) -> bytes:
    """A SentencePiece piece's bytes: `<0xNN>` is byte NN (byte fallback), "▁" a space."""
    m = _BYTE_PIECE.fullmatch(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()


def _utf8_complete_prefix(data: bytes) -> bytes:
    """Drop an incomplete UTF-8 sequence at the end of `data` (a token may end mid-character)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 == 0x80:  # continuation byte: keep looking for the lead byte
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return data[:-back] if need > back else data
    return data


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Like transformers: no HTML escaping, unicode kept.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _compile_template(source: str) -> jinja2.Template:
    # Same environment as transformers' apply_chat_template.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode/decode token ids and render chat prompts for one model."""

    def __init__(self, spec: TokenizerSpec, name: str = "model") -> None:
        self.spec, self.name = spec, name
        self._template = _compile_template(spec.chat_template) if spec.chat_template else None
        self._special_ids = set(spec.special.values())
        self._sp = None
        if spec.sentencepiece is not None:
            import tokenizers

            self._sp = tokenizers.Tokenizer.from_str(spec.sentencepiece)
            self.token_bytes = [tok.encode() if tok in spec.special else _piece_bytes(tok) for tok in spec.tokens]
            self._byte_piece = [tok not in spec.special and _BYTE_PIECE.fullmatch(tok) is not None
                                for tok in spec.tokens]
            self.encoding: tiktoken.Encoding | None = None
            return
        ranks: dict[bytes, int] = {}
        self.token_bytes = []
        for i, tok in enumerate(spec.tokens):
            b = None if tok in spec.special else _token_bytes(tok)
            # an added token written in plain text, or an id the file leaves out, decodes as its text
            self.token_bytes.append(tok.encode() if b is None else b)
            if b is not None and tok:
                ranks.setdefault(b, i)
        self.encoding = tiktoken.Encoding(
            name=f"pie-{name}", pat_str=spec.pattern, mergeable_ranks=ranks, special_tokens=dict(spec.special)
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its spec (an instance worker makes its own: host/workers/)."""
        return Tokenizer, (self.spec, self.name)

    @property
    def vocab_size(self) -> int:
        return len(self.spec.tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) are recognised."""
        if self._sp is not None:
            return list(self._sp.encode(text, add_special_tokens=False).ids)
        assert self.encoding is not None  # the byte-level layout
        if self.spec.normalizer is not None:
            text = unicodedata.normalize(self.spec.normalizer, text)  # type: ignore[arg-type]
        return self.encoding.encode(text, allowed_special="all")

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw prompt as transformers' `tokenizer(text)` gives them: `encode`, after
        BOS where the tokenizer adds one and before the tokens its post-processor appends (GGUF
        add_bos_token; Qwen3-Embedding's EOS). Not for a rendered chat template, which writes its own
        `bos_token`."""
        ids = self.encode(text) + list(self.spec.suffix)
        bos = self.spec.bos_token_id
        return [bos, *ids] if self.spec.add_bos and bos is not None else ids

    def encode_ordinary(self, text: str) -> list[int]:
        """Token ids of `text` with no special token recognised (text that names one is spelled out).
        Byte-level layout only: a SentencePiece-style one raises ValueError (its normalizer prepends a
        space to any text, so fragments do not tokenize apart from their context)."""
        if self.encoding is None:
            raise ValueError("encode_ordinary: only byte-level tokenizers encode text fragments")
        if self.spec.normalizer is not None:
            text = unicodedata.normalize(self.spec.normalizer, text)  # type: ignore[arg-type]
        return self.encoding.encode_ordinary(text)

    @property
    def byte_level(self) -> bool:
        """True for the byte-level layout (tiktoken), False for the SentencePiece-style one."""
        return self.encoding is not None

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` as transformers decodes it (ids past the vocabulary decode to nothing); an
        incomplete UTF-8 sequence at the end is held back (it completes with later tokens)."""
        if self._sp is None:
            return _utf8_complete_prefix(self.decode_bytes(ids)).decode("utf-8", errors="replace")
        n = len(self.token_bytes)
        ids = [i for i in ids if 0 <= i < n]
        k = len(ids)  # hold back byte-fallback pieces (one byte each) that end mid-character
        while k > 0 and self._byte_piece[ids[k - 1]]:
            k -= 1
        tail = b"".join(self.token_bytes[i] for i in ids[k:])
        # the decoder (Replace / ByteFallback / Fuse / Strip or Metaspace) joins pieces between
        # added tokens as transformers does
        return str(self._sp.decode(ids[: k + len(_utf8_complete_prefix(tail))], skip_special_tokens=False))

    def decode_bytes(self, ids: list[int]) -> bytes:
        """The bytes of `ids` joined (b"" for an id past the vocabulary); SentencePiece-style pieces
        as they are, before the decoder drops a prepended space."""
        table, n = self.token_bytes, len(self.token_bytes)
        return b"".join(table[i] if 0 <= i < n else b"" for i in ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_string(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.spec.tokens[token_id]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's own template, as transformers' apply_chat_template does."""
        if self._template is None:
            raise ValueError("this model has no chat template (a base model?): give it raw prompts (text_completion --raw)")
        s = self.spec
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_string(s.bos_token_id) or "",
            eos_token=self.token_string(s.eos_token_id) or "",
            pad_token=self.token_string(s.pad_token_id) or "",
            **kwargs,
        )
