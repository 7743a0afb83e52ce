"""Sharing a context's KV: `fork` within the instance, export / import by name across instances.

A fork shares the full pages (ref-counted in `PAGES`) and copies the partial last one, which only
its owner may write. Exported pages go through `kv.export-pages` / `kv.import-pages`; the history
that makes them a `Context` again (tokens, positions, masks, chat) is kept in the store under
`inferlet.context/<name>`. Imported pages are read-only, so a partial last page is continued in
an own copy.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from inferlet import _host
from inferlet.pages import PAGES

if TYPE_CHECKING:
    from inferlet.context import Context

__all__ = ["export_context", "fork_context", "import_context", "unexport"]

_META = "inferlet.context/"  # store key prefix for the token history of exported contexts


def fork_context(ctx: Context, child: Context) -> Context:
    """Make the fresh context `child` a copy of `ctx` sharing its full pages."""
    full, rem = divmod(ctx.kv_len, ctx.model.page_size)
    PAGES.share(ctx.pages[:full])
    child.pages = ctx.pages[:full]
    if rem:
        (page,) = PAGES.allocate(1)
        _host.kv.copy_tokens(ctx.pages[full], 0, page, 0, rem)
        child.pages.append(page)
    child.kv_len, child.next_pos = ctx.kv_len, ctx.next_pos
    child.tokens, child.positions, child.masked = ctx.tokens.copy(), ctx.positions.copy(), ctx.masked.copy()
    child.messages, child._chat_text = [dict(m) for m in ctx.messages], ctx._chat_text
    return child


def export_context(ctx: Context, name: str, persistent: bool) -> None:
    """Export `ctx`'s pages (the partial last one as a copy) and its history under `name`."""
    ps = ctx.model.page_size
    full, rem = divmod(ctx.kv_len, ps)
    pages = ctx.pages[:full]
    copy: list[int] = []
    if rem:
        copy = PAGES.allocate(1)
        _host.kv.copy_tokens(ctx.pages[full], 0, copy[0], 0, rem)
    try:
        _host.kv.export_pages(name, pages + copy, persistent)
    except _host.Err as e:
        PAGES.release(copy)
        raise KeyError(f"kv.export-pages({name!r}): {e.value}") from None
    PAGES.release(copy)  # the export keeps its own reference
    meta = {"kv_len": ctx.kv_len, "tokens": ctx.tokens, "positions": ctx.positions,
            "masked": ctx.masked, "next_pos": ctx.next_pos, "page_size": ps,
            "messages": ctx.messages, "chat_text": ctx._chat_text}  # fmt: skip
    _host.store.set(_META + name, json.dumps(meta))


def import_context(ctx: Context, name: str) -> Context:
    """Fill the fresh context `ctx` with the one exported under `name` (KeyError when none)."""
    raw = _host.store.get(_META + name)
    if raw is None:
        raise KeyError(f"no context exported as {name!r} (export it with Context.export)")
    try:
        pages = list(_host.kv.import_pages(name))
    except _host.Err as e:
        raise KeyError(f"kv.import-pages({name!r}): {e.value}") from None
    PAGES.adopt(pages)
    meta = json.loads(raw)
    full, rem = divmod(meta["kv_len"], ctx.model.page_size)
    if rem:  # imported pages are read-only: continue in an own copy of the partial page
        (own,) = PAGES.allocate(1)
        _host.kv.copy_tokens(pages[full], 0, own, 0, rem)
        PAGES.release([pages[full]])
        pages[full] = own
    ctx.pages, ctx.kv_len = pages, meta["kv_len"]
    ctx.tokens, ctx.positions, ctx.masked = meta["tokens"], meta["positions"], meta["masked"]
    ctx.next_pos, ctx.messages, ctx._chat_text = meta["next_pos"], meta["messages"], meta["chat_text"]
    return ctx


def unexport(name: str) -> None:
    """Remove an exported name (KeyError when unknown)."""
    try:
        _host.kv.unexport(name)
    except _host.Err as e:
        raise KeyError(f"kv.unexport({name!r}): {e.value}") from None
    _host.store.delete(_META + name)
