"""The model and its tokenizer, as the host serves them."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from inferlet import _host

__all__ = ["Model", "ModelError", "TemplateError", "get_model", "available_models"]


class ModelError(RuntimeError):
    """The host could not load the requested model (the message names the available ones)."""


class TemplateError(ValueError):
    """The chat template could not render the messages (it raised, or they are not what it reads)."""


class Model:
    """The selected model. Facts that cannot change (page size, stop tokens, template) are cached."""

    def __init__(self) -> None:
        self._name: str | None = None
        self._page_size: int | None = None
        self._stop: tuple[int, ...] | None = None
        self._template: str | None = None

    @property
    def name(self) -> str:
        """The model's name."""
        if self._name is None:
            self._name = _host.model.model_name()
        return self._name

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        if self._page_size is None:
            self._page_size = int(_host.kv.page_size())
        return self._page_size

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary."""
        return int(_host.model.vocab_size())

    @property
    def stop_tokens(self) -> tuple[int, ...]:
        """Tokens that end a turn (eos, end-of-turn markers)."""
        if self._stop is None:
            self._stop = tuple(_host.model.stop_tokens())
        return self._stop

    @property
    def chat_template(self) -> str:
        """The model's chat template (jinja2 source)."""
        if self._template is None:
            self._template = _host.model.chat_template()
        return self._template

    def encode(self, text: str) -> list[int]:
        """Text -> token ids; special tokens such as <|im_start|> are recognised."""
        return list(_host.model.encode(text))

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt (no chat template) -> token ids as transformers' `tokenizer(text)` gives them:
        `encode`, after BOS where the model's tokenizer adds one (Llama 2, Mistral, Gemma, ...)."""
        return list(_host.model.encode_prompt(text))

    def decode(self, tokens: Iterable[int]) -> str:
        """Token ids -> text; an incomplete UTF-8 sequence at the end is dropped."""
        return _host.model.decode(list(tokens))

    def apply_chat_template(
        self, messages: Iterable[Mapping[str, str] | tuple[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render messages ({"role", "content"} maps or (role, content) pairs) with the model's template."""
        wit = [_to_message(m) for m in messages]
        return _host.model.apply_chat_template(wit, add_generation_prompt)

    def apply_chat_template_json(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                                 add_generation_prompt: bool = True) -> str:
        """Render messages as OpenAI/transformers write them (`tool_calls`, role `tool`, ...) with the
        model's template, `tools` in its context (WIT 0.3.0). TemplateError when the template raises."""
        try:
            return str(_host.model.apply_chat_template_json(json.dumps(messages), json.dumps(tools) if tools else "",
                                                            add_generation_prompt))
        except _host.Err as e:
            raise TemplateError(str(e.value)) from None

    def _reset(self) -> None:
        self._name = self._page_size = self._stop = self._template = None


def _to_message(m: Mapping[str, str] | tuple[str, str]) -> object:
    if isinstance(m, tuple):
        role, content = m
    else:
        try:
            role, content = m["role"], m["content"]
        except KeyError as e:
            raise ValueError(f"chat message {m!r} needs 'role' and 'content'") from e
    return _host.model.Message(role=role, content=content)


_MODEL = Model()


def get_model(name: str | None = None) -> Model:
    """The selected model; with `name`, select that model first (ModelError when unknown)."""
    if name is not None:
        try:
            _host.model.load_model(name)
        except _host.Err as e:
            raise ModelError(str(e.value)) from None
        _MODEL._reset()
    return _MODEL


def available_models() -> list[str]:
    """Names of the models the host serves."""
    return list(_host.model.available_models())
