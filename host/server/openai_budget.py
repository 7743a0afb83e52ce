"""What a completion request's tokens must fit, checked before anything is launched (issue 37).

`PromptBudget.check` counts the prompt with the model's own tokenizer and chat template (what the
standard handler fills) and answers OpenAI's `context_length_exceeded` when it cannot fit the
model's context or the KV pages one request may hold; without `max_tokens` given, it lowers
`max_tokens` to what fits (as vLLM does). A handler that formats prompts otherwise may differ by
a few tokens at the edge.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jinja2
from inferlet.context import IMAGE_MARK
from inferlet.toolcalls import plain_chat, render_chat

from host.server.openai_errors import OpenAIError
from host.server.openai_request import OpenAIRequest

__all__ = ["PromptBudget"]


@dataclasses.dataclass(frozen=True)
class PromptBudget:
    """What a request's tokens must fit: `count` gives a request's prompt tokens (as the handler
    fills them), `context` is the model's context length (0 = unknown), `kv_tokens` what the KV
    pages one request may hold can take."""

    count: Callable[[OpenAIRequest], int]
    context: int
    kv_tokens: int

    @classmethod
    def of(cls, host: Any) -> PromptBudget | None:
        """The budget of a `host.Host` (None for a host without a tokenizer, e.g. a test's fake)."""
        backend = getattr(host, "backend", None)
        config = getattr(host, "config", None)
        if backend is None or config is None:
            return None
        info, tok = backend.info, backend.tokenizer
        caps = [info.num_pages, config.max_pages_per_instance, config.max_pages_per_tenant]
        pages = min(c for c in caps if c is not None)

        def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
            try:
                return tok.apply_chat_template(messages, add_generation_prompt=True, **({"tools": tools} if tools else {}))
            except (jinja2.TemplateError, TypeError) as e:  # as the host's apply-chat-template-json reports it
                raise ValueError(str(e)) from None

        def count(req: OpenAIRequest) -> int:
            if isinstance(req.prompt, tuple):  # token ids: the handler refuses ids outside the vocabulary
                return len(req.prompt)
            if req.messages is None:
                return len(tok.encode(req.prompt or ""))
            messages = [dict(m) for m in req.messages]
            tools = list(req.tools or ()) if req.tool_choice != "none" else None
            images = sum(isinstance(p, dict) and p.get("type") in ("image", "image_url")
                         for m in messages if isinstance(m.get("content"), list) for p in m["content"])
            if images:  # as the handler fills them: the text around each image, the image's placeholders
                for m in messages:
                    if isinstance(m.get("content"), list):
                        m["content"] = "".join(IMAGE_MARK if p.get("type") != "text" else p.get("text", "")
                                               for p in m["content"])
                text = (tok.apply_chat_template(messages, add_generation_prompt=True) if plain_chat(messages, tools)
                        else render_chat(render, info.chat_template, messages, tools)[0])
                pieces = text.split(IMAGE_MARK)
                return sum(len(tok.encode(p)) for p in pieces if p) + images * int(getattr(info, "image_tokens", 0))
            if plain_chat(messages, tools):
                return len(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)))
            return len(tok.encode(render_chat(render, info.chat_template, messages, tools)[0]))  # as the handler

        return cls(count, info.max_position, pages * info.page_size)

    def check(self, req: OpenAIRequest) -> OpenAIRequest:
        """`req` with `max_tokens` cut to what fits when it was not given; OpenAIError
        `context_length_exceeded` when the prompt (or the prompt and the `max_tokens` asked for)
        cannot fit the context or the KV pages."""
        param = "messages" if req.messages is not None else "prompt"
        try:
            prompt = self.count(req)
        except (ValueError, TypeError, jinja2.TemplateError) as e:  # e.g. a template that wants roles to alternate
            raise OpenAIError(400, f"{param}: the model's chat template cannot format these messages: "
                              f"{str(e)[:300]}", param=param) from None
        limit, what = self.kv_tokens, f"the {self.kv_tokens} tokens the KV cache can hold for one request"
        if self.context and self.context <= limit:
            limit, what = self.context, f"the model's maximum context length of {self.context} tokens"
        need = prompt + req.n * req.max_tokens
        if prompt >= limit or (req.max_tokens_given and need > limit):
            asked = (f"{need} tokens ({prompt} in the {param}, {req.n} x {req.max_tokens} in the completion)"
                     if req.max_tokens_given else f"{prompt} tokens in the {param}")
            raise OpenAIError(400, f"this request needs {asked}, more than {what}; shorten the {param} "
                              "or lower max_tokens", param=param, code="context_length_exceeded")
        if not req.max_tokens_given:
            return dataclasses.replace(req, max_tokens=max(1, min(req.max_tokens, (limit - prompt) // req.n)))
        return req
