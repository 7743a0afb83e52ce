"""Byte-level BPE tokenizer on tiktoken, plus the model's chat template rendered with jinja2."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import tiktoken
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpu_backend.loading.loader import TokenizerSpec


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
        ranks: dict[bytes, int] = {}
        for i, tok in enumerate(spec.tokens):
            if tok in spec.special or not tok:
                continue
            b = _token_bytes(tok)
            if b is not None:
                ranks.setdefault(b, i)
        self.encoding = tiktoken.Encoding(
            name=f"pie-{name}", pat_str=spec.pattern, mergeable_ranks=ranks, special_tokens=dict(spec.special)
        )
        self.spec = spec
        self._template = _compile_template(spec.chat_template) if spec.chat_template else None
        self._special_ids = set(spec.special.values())

    @property
    def vocab_size(self) -> int:
        return len(self.spec.tokens)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text (e.g. `<|im_end|>`) are recognised."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; an incomplete UTF-8 sequence at the end is dropped (it completes later)."""
        data = self.encoding.decode_bytes(ids)
        return _utf8_complete_prefix(data).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: list[int]) -> bytes:
        return self.encoding.decode_bytes(ids)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def token_string(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.spec.tokens[token_id]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` with the model's own template, as transformers' apply_chat_template does."""
        if self._template is None:
            raise ValueError("this model has no chat template")
        s = self.spec
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token_string(s.bos_token_id) or "",
            eos_token=self.token_string(s.eos_token_id) or "",
            pad_token=self.token_string(s.pad_token_id) or "",
            **kwargs,
        )
