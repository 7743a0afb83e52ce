"""WIT interface `model`: the loaded model, its tokenizer, stop tokens and chat template."""

from __future__ import annotations

import json
from typing import Any

from wasmtime.component import Variant

from gpu_backend.types import BackendInfo, Tokenizer
from host.api.guest import GuestError, Import, guest_import
from host.wasm.instance import Instance


def imports(info: BackendInfo, tok: Tokenizer) -> dict[str, Import]:
    @guest_import("model.available-models", before_launch=True)
    def available_models(inst: Instance) -> list[str]:
        return [info.name]

    @guest_import("model.load-model")
    def load_model(inst: Instance, name: str) -> str | None:
        if name != info.name:
            return f"unknown model {name!r}; available: {info.name}"
        return None

    @guest_import("model.model-name", before_launch=True)
    def model_name(inst: Instance) -> str:
        return info.name

    @guest_import("model.vocab-size", before_launch=True)
    def vocab_size(inst: Instance) -> int:
        return info.vocab_size

    @guest_import("model.stop-tokens", before_launch=True)
    def stop_tokens(inst: Instance) -> list[int]:
        return list(info.stop_tokens)

    @guest_import("model.chat-template", before_launch=True)
    def chat_template(inst: Instance) -> str:
        return info.chat_template

    @guest_import("model.apply-chat-template")
    def apply_chat_template(inst: Instance, messages: list[Any], add_generation_prompt: bool) -> str:
        msgs = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # template errors (e.g. raise_exception in the template) are guest input errors
            raise GuestError(f"chat template failed: {e}") from None

    @guest_import("model.apply-chat-template-json")
    def apply_chat_template_json(inst: Instance, messages: str, tools: str, add_generation_prompt: bool) -> Variant:
        """result<string, string>, tagged (both cases are strings): malformed JSON or a template that
        raised is the error case, for the guest to handle."""
        try:
            msgs, tool_list = json.loads(messages), json.loads(tools) if tools else None
        except ValueError as e:
            return Variant("err", f"apply-chat-template-json: malformed JSON: {e}")
        if not isinstance(msgs, list) or not all(isinstance(m, dict) for m in msgs) \
                or not (tool_list is None or isinstance(tool_list, list)):
            return Variant("err", "apply-chat-template-json: messages must be a JSON array of objects, tools an array or \"\"")
        kwargs = {"tools": tool_list} if tool_list else {}
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:  # template errors (raise_exception, a missing key) are the guest's to handle
            return Variant("err", f"chat template failed: {e}")
        return Variant("ok", text)

    @guest_import("model.encode")
    def encode(inst: Instance, text: str) -> list[int]:
        return tok.encode(text)

    @guest_import("model.encode-prompt")
    def encode_prompt(inst: Instance, text: str) -> list[int]:
        return tok.encode_prompt(text)

    @guest_import("model.decode")
    def decode(inst: Instance, tokens: list[int]) -> str:
        for t in tokens:
            if t >= info.vocab_size:
                raise GuestError(f"token id {t} is outside the vocabulary (size {info.vocab_size})")
        return tok.decode(tokens)

    return {"available-models": available_models, "load-model": load_model, "model-name": model_name,
            "vocab-size": vocab_size, "stop-tokens": stop_tokens, "chat-template": chat_template,
            "apply-chat-template": apply_chat_template, "apply-chat-template-json": apply_chat_template_json,
            "encode": encode, "encode-prompt": encode_prompt, "decode": decode}
