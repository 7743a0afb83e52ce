"""The generation loop behind `Context.generate`: decode, check the stop condition, stream text."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from inferlet.sampler import AnyOf, MaxTokens, Sampler, Stop, UntilTokens

if TYPE_CHECKING:
    from inferlet.context import Context

__all__ = ["generate"]


def generate(
    ctx: Context,
    sampler: Sampler,
    stop: Stop | None,
    max_tokens: int | None,
    on_text: Callable[[str], None] | None,
) -> str:
    """See `Context.generate`."""
    cond: Stop = stop if stop is not None else UntilTokens(ctx.model.stop_tokens)
    if max_tokens is not None:
        cond = AnyOf(MaxTokens(max_tokens), cond)
    ids: list[int] = []
    text, sent = "", 0
    decode_step, check, decode, seed = ctx.decode_step, cond.check, ctx.model.decode, sampler.seed
    while True:
        ids.append(decode_step(sampler if seed is None else sampler.with_seed(seed + len(ids))))
        trim = check(ids, decode)
        if on_text is not None:
            text = decode(ids[: len(ids) - (trim or 0)])
            if len(text) > sent:
                on_text(text[sent:])
                sent = len(text)
        if trim is not None:
            break
    if on_text is None:
        text = decode(ids[: len(ids) - trim])
    if ctx._chat_text is not None:
        # The KV now holds the generated tokens (the last one pending): the chat's text grows
        # by exactly their text, and the reply is an assistant message for the next render.
        ctx.messages.append({"role": "assistant", "content": text})
        ctx._chat_text += decode(ids) if trim else text
    return text
