"""The generation loop behind `Context.generate`: decode, check the stop condition, stream text.

When nothing but the host's own rules is needed (the model's stop tokens, stop texts, a token
budget; streaming to the client or none), the whole loop runs in the host with one call,
`forward.generate`: no wake-up of this guest per token. Otherwise (a custom stop condition, a
text callback, masked tokens) it runs here, one `decode_step` per token. Both give the same tokens.
With a grammar, the same two paths use the constrained host calls (inferlet/constrained.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from inferlet import _host, constrained
from inferlet.grammar import Grammar, Matcher
from inferlet.pages import PAGES
from inferlet.runtime import send
from inferlet.sampler import AnyOf, MaxTokens, Sampler, Stop, UntilText, UntilTokens

if TYPE_CHECKING:
    from inferlet.context import Context

__all__ = ["generate", "host_rules"]

U32_MAX = 2**32 - 1
_ORDER = {MaxTokens: 0, UntilTokens: 1, UntilText: 2}  # the order forward.generate checks them in


def host_rules(cond: Stop) -> tuple[int | None, list[int], list[str]] | None:
    """(max tokens, stop tokens, stop texts) if the host can check `cond` exactly as it is, else None."""
    parts = list(cond.conditions) if isinstance(cond, AnyOf) else [cond]
    if any(isinstance(p, AnyOf) for p in parts) or any(type(p) not in _ORDER for p in parts):
        return None
    ranks = [_ORDER[type(p)] for p in parts]
    if ranks != sorted(ranks) or ranks.count(0) > 1:
        return None
    n = next((p.n for p in parts if isinstance(p, MaxTokens)), None)
    stops = sorted({t for p in parts if isinstance(p, UntilTokens) for t in p.tokens})
    texts = [p.text for p in parts if isinstance(p, UntilText)]
    if any(not t for t in texts):
        return None  # UntilText raises on an empty text: keep that behaviour
    return n, stops, texts


def generate(
    ctx: Context,
    sampler: Sampler,
    stop: Stop | None,
    max_tokens: int | None,
    on_text: Callable[[str], None] | None,
    grammar: Grammar | Matcher | None = None,
) -> str:
    """See `Context.generate`."""
    if ctx._slots:  # pending vectors (an image) run first: the loops below take token ids only
        ctx._check_idle("generate")
        ctx._run_slots()
    matcher = None if grammar is None else constrained.as_matcher(grammar)
    cond: Stop = stop if stop is not None else UntilTokens(ctx.model.stop_tokens)
    if max_tokens is not None:
        cond = AnyOf(MaxTokens(max_tokens), cond)
    rules = host_rules(cond) if on_text is None or on_text is send else None
    if rules is not None and _host_loop_fits(ctx):
        ids, trim = _generate_on_host(ctx, sampler, rules, on_text is not None, matcher)
        text = ctx.model.decode(ids[: len(ids) - trim])
    else:
        ids, trim, text = _generate_here(ctx, sampler, cond, on_text, matcher)
    if ctx._chat_text is not None:
        # The KV now holds the generated tokens (the last one pending): the chat's text grows
        # by exactly their text, and the reply is an assistant message for the next render.
        ctx.messages.append({"role": "assistant", "content": text})
        ctx._chat_text += ctx.model.decode(ids) if trim else text
    return text


def _host_loop_fits(ctx: Context) -> bool:
    return (ctx._inflight is None and not ctx._released and len(ctx.tokens) > ctx.kv_len
            and not ctx.any_masked and ctx.next_pos == ctx.positions[-1] + 1)


def _generate_on_host(ctx: Context, sampler: Sampler, rules: tuple[int | None, list[int], list[str]],
                      stream: bool, matcher: Matcher | None) -> tuple[list[int], int]:
    """forward.generate, called again only when the host ran out of pages (we wait for one here)."""
    limit, stops, texts = rules
    ids: list[int] = []
    if matcher is None and _fresh(ctx):
        # One call takes the pages too (the prefix cache's, then fresh ones): no attach-prefix and
        # allocate calls before the first forward. Refused pages: the loop below waits for them.
        budget = U32_MAX if limit is None else limit
        g = _host.forward.generate_fresh(ctx.tokens, sampler.to_wit(), budget, stops, texts, stream,
                                         ctx.prefix_cache)
        if g.tokens:
            ctx._attach_tried = True
            ctx.kv_len = len(ctx.tokens)  # all pending tokens went in, as after ctx._prepare
            if _took(ctx, g, ids):
                return ids, g.trim
    while True:
        kv_len, n_pages = ctx.kv_len, len(ctx.pages)
        pages, last_len, tokens, positions, _mask = ctx._prepare(len(ctx.tokens) - ctx.kv_len)
        seeded = sampler if sampler.seed is None else sampler.with_seed(sampler.seed + len(ids))
        budget = U32_MAX if limit is None else max(limit - len(ids), 1)
        args = (last_len, tokens, positions, seeded.to_wit(), budget, stops, texts, stream)
        if matcher is None:
            g = _host.forward.generate(pages, *args)
        else:
            g = constrained.generate_on_host(ctx, pages, args, matcher, kv_len, n_pages)
        if _took(ctx, g, ids):
            return ids, g.trim


def _took(ctx: Context, g: Any, ids: list[int]) -> bool:
    """Take a host generation's pages and tokens into `ctx` (and `ids`); whether it finished
    (False: it ran out of pages, and the caller goes on once it has one)."""
    PAGES.adopt(list(g.new_pages))
    ctx.pages.extend(g.new_pages)
    ctx.kv_len += len(g.tokens) - 1  # the pending tokens and all drawn tokens but the last
    ctx._append_pending(list(g.tokens))
    ids.extend(g.tokens)
    return _finish_name(g.finish) != "out-of-pages"


def _fresh(ctx: Context) -> bool:
    """Nothing of `ctx` in the KV cache yet, its tokens at positions 0, 1, ... (forward.generate-fresh)."""
    return not ctx.pages and ctx.kv_len == 0 and not ctx._attach_tried and ctx.positions == list(range(len(ctx.tokens)))


def _finish_name(finish: object) -> str:
    """The WIT enum as its kebab-case name (a bindings Enum member inside the guest, a str in tests)."""
    name = getattr(finish, "name", finish)
    return str(name).lower().replace("_", "-")


def _generate_here(ctx: Context, sampler: Sampler, cond: Stop, on_text: Callable[[str], None] | None,
                   matcher: Matcher | None) -> tuple[list[int], int, str]:
    ids: list[int] = []
    text, sent = "", 0
    check, decode, seed = cond.check, ctx.model.decode, sampler.seed
    stops = set(ctx.model.stop_tokens)

    def decode_step(s: Sampler) -> int:
        return ctx.decode_step(s, matcher)

    while True:
        ids.append(decode_step(sampler if seed is None else sampler.with_seed(seed + len(ids))))
        trim = check(ids, decode)
        if trim is None and matcher is not None and ids[-1] in stops and matcher.is_terminated():
            trim = 1  # the grammar's output is complete
        if on_text is not None:
            text = decode(ids[: len(ids) - (trim or 0)])
            if len(text) > sent:
                on_text(text[sent:])
                sent = len(text)
        if trim is not None:
            break
    if on_text is None:
        text = decode(ids[: len(ids) - trim])
    return ids, trim, text
