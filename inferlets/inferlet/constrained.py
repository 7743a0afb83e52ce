"""The grammar-constrained host calls behind `Context.decode_step(matcher=...)`,
`Context.submit_decode(matcher=...)` and `Context.generate(grammar=...)`: forward.decode-step-constrained,
forward.run-constrained, forward.submit-constrained and forward.generate-constrained. The host masks the draw and advances the matcher; nothing per token
comes back here but the token. When the host refuses (the grammar admits no token), the context is
put back as it was before the call and GrammarError is raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferlet import _host
from inferlet.forward import Forward
from inferlet.grammar import Grammar, GrammarError, Matcher
from inferlet.pages import PAGES
from inferlet.sampler import Sampler

if TYPE_CHECKING:
    from inferlet.context import Context

__all__ = ["as_matcher", "decode_step", "generate_on_host", "submit_decode"]


def as_matcher(grammar: Grammar | Matcher) -> Matcher:
    """A new matcher for a Grammar; a Matcher as it is (generation goes on from where it stands)."""
    if isinstance(grammar, Matcher):
        return grammar
    if isinstance(grammar, Grammar):
        return grammar.matcher()
    raise TypeError(f"grammar must be an inferlet Grammar or Matcher, got {type(grammar).__name__}")


def _undo(ctx: Context, kv_len: int, n_pages: int) -> None:
    """Back to before a pass the host refused: its pages released, its tokens pending again."""
    extra = ctx.pages[n_pages:]
    if extra:
        PAGES.release(extra)
        del ctx.pages[n_pages:]
    ctx.kv_len = kv_len


def decode_step(ctx: Context, sampler: Sampler, matcher: Matcher) -> int:
    """`Context.decode_step` drawing from the tokens `matcher` allows (the matcher accepts the token)."""
    ctx._check_idle("decode_step")
    kv_len, n_pages = ctx.kv_len, len(ctx.pages)
    try:
        if len(ctx.tokens) == kv_len + 1 and not ctx.any_masked and kv_len > 0:
            pages, last_len, tokens, positions, _mask = ctx._prepare(1)
            token: int = _host.forward.decode_step_constrained(pages, last_len, tokens[0], positions[0],
                                                               sampler.to_wit(), matcher.handle)
        else:
            spec = ctx._spec(sampler, 0)
            kv_len, n_pages = ctx.kv_len, len(ctx.pages)  # after a prefix-cache attach
            outs = _host.forward.run_constrained(*ctx._prepare_all("decode_step"), [spec], 0, matcher.handle)
            token = outs[0].token
    except _host.Err as e:
        _undo(ctx, kv_len, n_pages)
        raise GrammarError(str(e.value)) from None
    ctx._append_pending([token])
    return token


def submit_decode(ctx: Context, sampler: Sampler, matcher: Matcher) -> Forward:
    """`Context.submit_decode` through forward.submit-constrained (the caller records the in-flight pass)."""
    ctx._check_idle("submit_decode")
    spec = ctx._spec(sampler, 0)
    kv_len, n_pages = ctx.kv_len, len(ctx.pages)
    try:
        h = _host.forward.submit_constrained(*ctx._prepare_all("submit_decode"), [spec], 0, matcher.handle)
    except _host.Err as e:
        _undo(ctx, kv_len, n_pages)
        raise GrammarError(str(e.value)) from None
    return Forward(ctx, h, "token")


def generate_on_host(ctx: Context, pages: list[int], args: tuple[Any, ...], matcher: Matcher,
                     kv_len: int, n_pages: int) -> Any:
    """forward.generate-constrained with `args` as forward.generate's (after `ctx._prepare`)."""
    try:
        return _host.forward.generate_constrained(pages, *args, matcher.handle)
    except _host.Err as e:
        _undo(ctx, kv_len, n_pages)
        raise GrammarError(str(e.value)) from None
