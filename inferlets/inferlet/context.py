"""`Context`: one token sequence in KV pages, with fill / decode / generate / fork / export.

Invariants (checked by the tests in tests/test_sdk_context.py):
  * `tokens` are the live tokens: the first `kv_len` have K/V in `pages`, the rest are pending.
  * `len(pages) == ceil(kv_len / page_size)`; every page but the last is full.
  * Full pages may be shared with forks (ref-counted in `PAGES`) and are never written again;
    the last, partial page is always this context's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from inferlet import _host
from inferlet.mask import pass_rows
from inferlet.model import Model, get_model
from inferlet.pages import PAGES
from inferlet.sampler import GREEDY, AnyOf, MaxTokens, Sampler, Stop, UntilTokens

__all__ = ["Context", "Forward", "wait_any", "ChatError"]

_META = "inferlet.context/"  # store key prefix for the token history of exported contexts


class ChatError(ValueError):
    """The chat so far no longer renders as a prefix of the new chat (see `Context.fill_chat`)."""


class Forward:
    """An in-flight forward pass from `Context.submit_decode` / `submit_dist`."""

    def __init__(self, ctx: Context, handle: int, kind: str) -> None:
        self.ctx, self.handle, self.kind = ctx, handle, kind
        self.done = False
        self.result: Any = None  # token id ("token") or (ids, probs) ("dist")

    def wait(self) -> Any:
        """Block until the pass is done; returns the sampled token or the (ids, probs) pair."""
        if not self.done:
            self._finish(_host.forward.wait(self.handle))
        return self.result

    def _finish(self, outputs: list[Any]) -> None:
        out = outputs[0]
        if self.kind == "token":
            self.result = out.token
            self.ctx._append_pending([out.token])
        else:
            self.result = (list(out.ids), list(out.probs))
        self.done = True
        self.ctx._inflight = None


def wait_any(passes: Sequence[Forward]) -> Forward:
    """Block until one of the passes is done and return it (already-done ones return at once)."""
    for f in passes:
        if f.done:
            return f
    handle, outputs = _host.forward.wait_any([f.handle for f in passes])
    for f in passes:
        if f.handle == handle:
            f._finish(outputs)
            return f
    raise RuntimeError(f"forward.wait-any returned unknown handle {handle}")


class Context:
    """A token sequence whose K/V lives in pages this instance holds. Use as a context manager."""

    def __init__(self, model: Model | None = None) -> None:
        self.model = model or get_model()
        self.pages: list[int] = []
        self.kv_len = 0
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.masked: list[bool] = []
        self.next_pos = 0
        self.messages: list[dict[str, str]] = []
        self._chat_text: str | None = None
        self._inflight: Forward | None = None
        self._released = False
        self._generation = PAGES.generation

    # ---- filling -------------------------------------------------------------------------

    def fill(self, text: str) -> None:
        """Append text (tokenized on its own, so split points matter) as pending tokens."""
        self.fill_tokens(self.model.encode(text))

    def fill_tokens(self, ids: Iterable[int]) -> None:
        """Append token ids as pending tokens; they reach the KV cache at the next pass."""
        self._check_idle("fill_tokens")
        self._append_pending(list(ids))

    def fill_chat(self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True) -> None:
        """Append chat messages, formatted by the model's own template.

        The whole chat is rendered again and only the new suffix is filled, so the text equals
        the template's rendering of the full chat (what `transformers` feeds the model).
        """
        self._check_idle("fill_chat")
        self.messages.extend({"role": m["role"], "content": m["content"]} for m in messages)
        rendered = self.model.apply_chat_template(self.messages, add_generation_prompt)
        before = self._chat_text or ""
        if not rendered.startswith(before):
            raise ChatError(
                "the chat template renders the new chat differently from what this context holds; "
                "fill a generation prompt only right before generating"
            )
        self._chat_text = rendered
        if len(rendered) > len(before):
            self.fill(rendered[len(before) :])

    def fill_system(self, text: str) -> None:
        """A system message (no generation prompt)."""
        self.fill_chat([{"role": "system", "content": text}], add_generation_prompt=False)

    def fill_user(self, text: str, add_generation_prompt: bool = True) -> None:
        """A user message, followed by the assistant's generation prompt unless told otherwise."""
        self.fill_chat([{"role": "user", "content": text}], add_generation_prompt)

    def fill_assistant(self, text: str) -> None:
        """An assistant message written by the inferlet (not generated)."""
        self.fill_chat([{"role": "assistant", "content": text}], add_generation_prompt=False)

    # ---- forward passes ------------------------------------------------------------------

    def flush(self) -> None:
        """Prefill all pending tokens but the last, which stays as the next decode step's input."""
        self._check_idle("flush")
        n = len(self.tokens) - self.kv_len - 1
        if n > 0:
            _host.forward.run(*self._prepare(n), [])

    def decode_step(self, sampler: Sampler = GREEDY) -> int:
        """Run the pending tokens and sample the next one (appended as pending). One host call."""
        n = self.kv_len + 1
        tokens, pages = self.tokens, self.pages
        if len(tokens) == n and self._inflight is None and not self._released and True not in self.masked:
            # The plain step (one pending token, causal): forward.decode-step, whose only list is
            # the pages. Written out flat: this runs once per generated token.
            ps = self.model.page_size
            if n > len(pages) * ps:
                pages.extend(PAGES.allocate(1))
            self.kv_len = n
            pos = self.next_pos
            token = _host.forward.decode_step(pages, n - (len(pages) - 1) * ps, tokens[-1], self.positions[-1],
                                              sampler.to_wit())
            tokens.append(token)
            self.positions.append(pos)
            self.masked.append(False)
            self.next_pos = pos + 1
            return token
        self._check_idle("decode_step")
        spec = self._spec(sampler, 0)
        token = _host.forward.run(*self._prepare_all("decode_step"), [spec])[0].token
        self._append_pending([token])
        return token

    def next_dist(self, k: int) -> tuple[list[int], list[float]]:
        """Run the pending tokens; the k most probable next tokens and their probabilities.

        No token is appended: fill the one you choose (beam search forks, then fills).
        """
        self._check_idle("next_dist")
        spec = self._spec(None, k)
        out = _host.forward.run(*self._prepare_all("next_dist"), [spec])[0]
        return list(out.ids), list(out.probs)

    def submit_decode(self, sampler: Sampler = GREEDY) -> Forward:
        """`decode_step` without waiting: returns a `Forward`; the token is appended when it is done."""
        self._check_idle("submit_decode")
        spec = self._spec(sampler, 0)
        h = _host.forward.submit(*self._prepare_all("submit_decode"), [spec])
        self._inflight = Forward(self, h, "token")
        return self._inflight

    def submit_dist(self, k: int) -> Forward:
        """`next_dist` without waiting: the `Forward`'s result is (ids, probs)."""
        self._check_idle("submit_dist")
        spec = self._spec(None, k)
        h = _host.forward.submit(*self._prepare_all("submit_dist"), [spec])
        self._inflight = Forward(self, h, "dist")
        return self._inflight

    def generate(
        self,
        sampler: Sampler = GREEDY,
        stop: Stop | None = None,
        max_tokens: int | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """Decode until `stop` (default: the model's stop tokens) or `max_tokens`; returns the text.

        `on_text(chunk)` streams the text as it grows: the whole output is decoded each step and
        the new suffix is passed on, so a character split across tokens arrives whole.
        With a seeded sampler, step i draws with seed + i. Stop tokens are left out of the text
        (they stay pending in the context, as the next turn's first input).
        """
        cond: Stop = stop if stop is not None else UntilTokens(self.model.stop_tokens)
        if max_tokens is not None:
            cond = AnyOf(MaxTokens(max_tokens), cond)
        ids: list[int] = []
        text, sent = "", 0
        decode_step, check, decode, seed = self.decode_step, cond.check, self.model.decode, sampler.seed
        while True:
            ids.append(decode_step(sampler if seed is None else sampler.with_seed(seed + len(ids))))
            trim = check(ids, decode)
            if on_text is not None:
                text = self.model.decode(ids[: len(ids) - (trim or 0)])
                if len(text) > sent:
                    on_text(text[sent:])
                    sent = len(text)
            if trim is not None:
                break
        if on_text is None:
            text = self.model.decode(ids[: len(ids) - trim])
        if self._chat_text is not None:
            # The KV now holds the generated tokens (the last one pending): the chat's text grows
            # by exactly their text, and the reply is an assistant message for the next render.
            self.messages.append({"role": "assistant", "content": text})
            self._chat_text += self.model.decode(ids) if trim else text
        return text

    # ---- sharing and dropping -------------------------------------------------------------

    def fork(self) -> Context:
        """A copy that shares this context's full pages; the partial last page is copied."""
        self._check_idle("fork")
        child = Context(self.model)
        ps = self.model.page_size
        full, rem = divmod(self.kv_len, ps)
        PAGES.share(self.pages[:full])
        child.pages = self.pages[:full]
        if rem:
            (page,) = PAGES.allocate(1)
            _host.kv.copy_tokens(self.pages[full], 0, page, 0, rem)
            child.pages.append(page)
        child._copy_state(self)
        return child

    def mask_token_range(self, start: int, end: int, masked: bool = True) -> None:
        """Hide (or show again) `tokens[start:end]` from the attention of all later passes."""
        if not 0 <= start <= end <= len(self.tokens):
            raise IndexError(f"token range [{start}, {end}) outside 0..{len(self.tokens)}")
        self.masked[start:end] = [masked] * (end - start)

    def drop_masked_pages(self) -> int:
        """Release full pages whose tokens are all masked; returns how many were dropped.

        Their tokens leave `tokens`; positions of the remaining tokens are unchanged.
        """
        self._check_idle("drop_masked_pages")
        ps = self.model.page_size
        keep: list[int] = []
        drop: list[int] = []
        for j in range(len(self.pages)):
            lo = j * ps
            if lo + ps <= self.kv_len and all(self.masked[lo : lo + ps]):
                drop.append(j)
            else:
                keep.append(j)
        if not drop:
            return 0
        dropped = set(drop)
        idx = [i for i in range(len(self.tokens)) if i >= self.kv_len or i // ps not in dropped]
        self.tokens = [self.tokens[i] for i in idx]
        self.positions = [self.positions[i] for i in idx]
        self.masked = [self.masked[i] for i in idx]
        PAGES.release([self.pages[j] for j in drop])
        self.pages = [self.pages[j] for j in keep]
        self.kv_len -= ps * len(drop)
        return len(drop)

    def export(self, name: str, persistent: bool = False) -> None:
        """Share this context's KV under `name` (pending tokens included in the history).

        The partial last page is exported as a copy, so this context can go on writing its own.
        """
        self._check_idle("export")
        ps = self.model.page_size
        full, rem = divmod(self.kv_len, ps)
        pages = self.pages[:full]
        copy: list[int] = []
        if rem:
            copy = PAGES.allocate(1)
            _host.kv.copy_tokens(self.pages[full], 0, copy[0], 0, rem)
        try:
            _host.kv.export_pages(name, pages + copy, persistent)
        except _host.Err as e:
            PAGES.release(copy)
            raise KeyError(f"kv.export-pages({name!r}): {e.value}") from None
        PAGES.release(copy)  # the export keeps its own reference
        meta = {"kv_len": self.kv_len, "tokens": self.tokens, "positions": self.positions,
                "masked": self.masked, "next_pos": self.next_pos, "page_size": ps,
                "messages": self.messages, "chat_text": self._chat_text}  # fmt: skip
        _host.store.set(_META + name, json.dumps(meta))

    @classmethod
    def import_(cls, name: str, model: Model | None = None) -> Context:
        """A context continuing a context exported under `name` (KeyError when there is none)."""
        raw = _host.store.get(_META + name)
        if raw is None:
            raise KeyError(f"no context exported as {name!r} (export it with Context.export)")
        try:
            pages = list(_host.kv.import_pages(name))
        except _host.Err as e:
            raise KeyError(f"kv.import-pages({name!r}): {e.value}") from None
        PAGES.adopt(pages)
        ctx = cls(model)
        meta = json.loads(raw)
        ps = ctx.model.page_size
        full, rem = divmod(meta["kv_len"], ps)
        if rem:  # imported pages are read-only: continue in an own copy of the partial page
            (own,) = PAGES.allocate(1)
            _host.kv.copy_tokens(pages[full], 0, own, 0, rem)
            PAGES.release([pages[full]])
            pages[full] = own
        ctx.pages, ctx.kv_len = pages, meta["kv_len"]
        ctx.tokens, ctx.positions, ctx.masked = meta["tokens"], meta["positions"], meta["masked"]
        ctx.next_pos, ctx.messages, ctx._chat_text = meta["next_pos"], meta["messages"], meta["chat_text"]
        return ctx

    @staticmethod
    def unexport(name: str) -> None:
        """Remove an exported name (KeyError when unknown)."""
        try:
            _host.kv.unexport(name)
        except _host.Err as e:
            raise KeyError(f"kv.unexport({name!r}): {e.value}") from None
        _host.store.delete(_META + name)

    def release(self) -> None:
        """Give this context's pages back (waiting for an in-flight pass first). Idempotent."""
        if self._released:
            return
        if self._inflight is not None:
            self._inflight.wait()
        self._released = True
        PAGES.release(self.pages)
        self.pages, self.kv_len = [], 0

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        # Garbage collection releases forgotten contexts; not while a pass is in flight (its
        # pages must stay until the host is done) nor after the page table was reset.
        if (
            not getattr(self, "_released", True)
            and self._inflight is None
            and self._generation == PAGES.generation
        ):
            self.release()

    # ---- internals -------------------------------------------------------------------------

    def _check_idle(self, call: str) -> None:
        if self._released:
            raise RuntimeError(f"Context.{call}: the context was released")
        if self._inflight is not None:
            raise RuntimeError(f"Context.{call}: a submitted pass is still in flight; wait for it first")

    def _append_pending(self, ids: list[int]) -> None:
        n = len(ids)
        self.tokens.extend(ids)
        self.positions.extend(range(self.next_pos, self.next_pos + n))
        self.masked.extend([False] * n)
        self.next_pos += n

    def _spec(self, sampler: Sampler | None, dist: int) -> Any:
        """The output spec for the last pending token (call before `_prepare` moves `kv_len`)."""
        index = len(self.tokens) - self.kv_len - 1
        return _host.forward.OutputSpec(
            index=index, sample=None if sampler is None else sampler.to_wit(), dist=dist
        )

    def _prepare_all(self, call: str) -> tuple[list[int], int, list[int], list[int], list[list[int]]]:
        n = len(self.tokens) - self.kv_len
        if n == 0:
            raise RuntimeError(f"Context.{call}: no pending token to run (fill or decode first)")
        return self._prepare(n)

    def _prepare(self, n: int) -> tuple[list[int], int, list[int], list[int], list[list[int]]]:
        """Pages, last-page length, tokens, positions and mask for the next `n` pending tokens.

        Allocates the pages they need and counts them as written (the pass is being submitted).
        """
        ps = self.model.page_size
        lo, hi = self.kv_len, self.kv_len + n
        need = -(-hi // ps) - len(self.pages)
        if need > 0:
            self.pages.extend(PAGES.allocate(need))
        mask = pass_rows(self.masked[:lo], self.masked[lo:hi]) if True in self.masked else []
        self.kv_len = hi
        return self.pages, hi - (len(self.pages) - 1) * ps, self.tokens[lo:hi], self.positions[lo:hi], mask

    def _copy_state(self, other: Context) -> None:
        self.kv_len, self.next_pos = other.kv_len, other.next_pos
        self.tokens, self.positions, self.masked = (
            other.tokens.copy(),
            other.positions.copy(),
            other.masked.copy(),
        )
        self.messages, self._chat_text = [dict(m) for m in other.messages], other._chat_text
