"""`Context`: one token sequence in KV pages, with fill / decode / generate / fork / export.

Invariants (checked by the tests in tests/test_sdk_context.py):
  * `tokens` are the live tokens: the first `kv_len` have K/V in `pages`, the rest are pending.
  * `len(pages) == ceil(kv_len / page_size)`; every page but the last is full.
  * Full pages may be shared with forks (ref-counted in `PAGES`) and are never written again;
    the last, partial page is always this context's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from inferlet import _host, constrained
from inferlet.forward import Forward, wait_any
from inferlet.generate import generate
from inferlet.grammar import Grammar, Matcher
from inferlet.mask import masked_full_pages, pass_rows
from inferlet.model import Model, get_model
from inferlet.pages import PAGES
from inferlet.sampler import GREEDY, Sampler, Stop
from inferlet.sharing import export_context, fork_context, import_context, unexport

__all__ = ["Context", "Forward", "wait_any", "ChatError"]


IMAGE_MARK = "\ue000"  # where an image part goes in a rendered chat (a private-use character)


class ChatError(ValueError):
    """The chat so far no longer renders as a prefix of the new chat (see `Context.fill_chat`)."""


class Context:
    """A token sequence whose K/V lives in pages this instance holds. Use as a context manager."""

    def __init__(self, model: Model | None = None, prefix_cache: bool = True) -> None:
        self.model = model or get_model()
        # Attach the host's cached K/V for the longest full-page prefix of what is filled from the
        # start (kv.attach-prefix), and prefill only the rest. False opts this context out.
        self.prefix_cache = prefix_cache
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
        self._attach_tried = False  # the cache is asked once, before the first pass
        self._slots: dict[int, Any] = {}  # pending token index -> the embed.Slot whose vectors go there
        self._generation = PAGES.generation

    @property
    def masked(self) -> list[bool]:
        """Per token, whether later passes skip it. Change it with `mask_token_range` (or assign a
        new list): the context keeps count of the masked tokens, so that a step need not scan them."""
        return self._masked

    @masked.setter
    def masked(self, flags: list[bool]) -> None:
        self._masked = flags
        self._n_masked = flags.count(True)

    @property
    def any_masked(self) -> bool:
        """Whether some token is masked (O(1): a plain step checks it every token)."""
        return self._n_masked > 0

    # ---- filling -------------------------------------------------------------------------

    def fill(self, text: str) -> None:
        """Append text (tokenized on its own, so split points matter) as pending tokens."""
        self.fill_tokens(self.model.encode(text))

    def fill_prompt(self, text: str) -> None:
        """Start the context with a raw prompt (no chat template), tokenized as transformers'
        `tokenizer(text)` does: BOS first where the model's tokenizer adds one."""
        if self.tokens or self.kv_len:
            raise ValueError("fill_prompt starts a context: this one already holds tokens (use fill)")
        self.fill_tokens(self.model.encode_prompt(text))

    def fill_tokens(self, ids: Iterable[int]) -> None:
        """Append token ids as pending tokens; they reach the KV cache at the next pass."""
        self._check_idle("fill_tokens")
        self._append_pending(list(ids))

    def fill_chat(self, messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True) -> None:
        """Append chat messages, formatted by the model's own template.

        The whole chat is rendered again and only the new suffix is filled, so the text equals
        the template's rendering of the full chat (what `transformers` feeds the model).
        A message's content may be a list of parts, `{"type": "text", "text": ...}` and
        `{"type": "image", "image": bytes}`: each image is filled where the template puts it
        (`fill_image`), the template given a marker in its place.
        """
        self._check_idle("fill_chat")
        images: list[bytes] = []
        for m in messages:
            content = m["content"]
            if isinstance(content, list):
                text = []
                for part in content:
                    if part.get("type") == "image":
                        images.append(bytes(part["image"]))
                        text.append(IMAGE_MARK)
                    else:
                        text.append(str(part.get("text", "")))
                content = "".join(text)
            self.messages.append({"role": m["role"], "content": content})
        rendered = self.model.apply_chat_template(self.messages, add_generation_prompt)
        before = self._chat_text or ""
        if not rendered.startswith(before):
            raise ChatError(
                "the chat template renders the new chat differently from what this context holds; "
                "fill a generation prompt only right before generating"
            )
        self._chat_text = rendered
        pieces = rendered[len(before) :].split(IMAGE_MARK)
        if len(pieces) - 1 != len(images):
            raise ChatError(f"the chat template placed {len(pieces) - 1} of the new messages' {len(images)} images")
        for k, piece in enumerate(pieces):
            if piece:
                self.fill(piece)
            if k < len(images):
                self.fill_image(images[k])

    def fill_image(self, image: bytes, media_type: str = "") -> None:
        """Append an image: the model's vision tower makes its vectors (WIT 0.5.0 `embed.embed-image`),
        which stand on as many placeholder tokens (the model's image token). Fill text after it before
        generating. Raises embed.EmbedError if the model takes no images or the image does not decode."""
        from inferlet import embed

        self._check_idle("fill_image")
        self.fill_slot(embed.embed_image(image, media_type), embed.image_token_id() or 0)

    def fill_slot(self, slot: Any, placeholder: int = 0) -> None:
        """Append an embedding slot's vectors (`inferlet.embed`) as pending inputs, on `placeholder`
        tokens; the slot is released once they have run."""
        self._check_idle("fill_slot")
        self._slots[len(self.tokens)] = slot
        self._append_pending([placeholder] * len(slot))

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
        if self._slots:
            self._run_slots()
            return
        n = len(self.tokens) - self.kv_len - 1
        if n > 0:
            _host.forward.run(*self._prepare(n), [])

    def flush_scored(self, k: int = 0) -> list[tuple[float, list[int], list[float]]]:
        """`flush`, scoring what it prefills, in the same one pass (WIT forward.run-scored, 0.3.0): for each
        pending token after the first, its log-probability given the tokens before it (the model's own
        distribution at temperature 1) and the `k` most probable tokens at its place with their
        probabilities. A fresh context would take a cached prefix's tokens without running them (no
        scores for them): make one to score with prefix_cache=False."""
        self._check_idle("flush_scored")
        if self.prefix_cache and self.kv_len == 0:
            raise RuntimeError("Context.flush_scored: a context with prefix_cache may skip pending tokens; "
                               "make it with Context(prefix_cache=False)")
        n = len(self.tokens) - self.kv_len - 1
        if n <= 0:
            return []
        targets = self.tokens[self.kv_len + 1 : self.kv_len + n + 1]
        specs = [_host.forward.OutputSpec(index=i, sample=None, dist=k) for i in range(n)]
        outs, logprobs = _host.forward.run_scored(*self._prepare(n), specs, targets)
        return [(float(lp), list(o.ids), list(o.probs)) for lp, o in zip(logprobs, outs, strict=True)]

    def decode_step(self, sampler: Sampler = GREEDY, matcher: Matcher | None = None) -> int:
        """Run the pending tokens and sample the next one (appended as pending). One host call.
        With `matcher`, the token is drawn from what its grammar allows and the matcher accepts it."""
        if matcher is not None:
            return constrained.decode_step(self, sampler, matcher)
        n = self.kv_len + 1
        tokens, pages = self.tokens, self.pages
        if len(tokens) == n and self._inflight is None and not self._released and not self._n_masked:
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
            self._masked.append(False)
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

    def submit_decode(self, sampler: Sampler = GREEDY, matcher: Matcher | None = None) -> Forward:
        """`decode_step` without waiting: returns a `Forward`; the token is appended when it is done.
        With `matcher`, constrained like `decode_step` (the matcher advances when the pass is done)."""
        if matcher is not None:
            self._inflight = constrained.submit_decode(self, sampler, matcher)
            return self._inflight
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
        grammar: Grammar | Matcher | None = None,
    ) -> str:
        """Decode until `stop` (default: the model's stop tokens) or `max_tokens`; returns the text.

        `on_text(chunk)` streams the text as it grows: the whole output is decoded each step and
        the new suffix is passed on, so a character split across tokens arrives whole.
        With a seeded sampler, step i draws with seed + i. Stop tokens are left out of the text
        (they stay pending in the context, as the next turn's first input).
        With `grammar` (`json_schema(...)`, `regex(...)`, `choice([...])`, ... or a `Matcher` to go on
        with), every token is drawn from what the grammar allows, and generation also ends when the
        grammar's output is complete; GrammarError if the grammar admits no token.
        """
        return generate(self, sampler, stop, max_tokens, on_text, grammar)

    # ---- sharing and dropping -------------------------------------------------------------

    def fork(self) -> Context:
        """A copy that shares this context's full pages; the partial last page is copied."""
        self._check_idle("fork")
        return fork_context(self, Context(self.model))

    def mask_token_range(self, start: int, end: int, masked: bool = True) -> None:
        """Hide (or show again) `tokens[start:end]` from the attention of all later passes."""
        if not 0 <= start <= end <= len(self.tokens):
            raise IndexError(f"token range [{start}, {end}) outside 0..{len(self.tokens)}")
        self._masked[start:end] = [masked] * (end - start)
        self._n_masked = self._masked.count(True)

    def drop_masked_pages(self) -> int:
        """Release full pages whose tokens are all masked; returns how many were dropped.

        Their tokens leave `tokens`; positions of the remaining tokens are unchanged.
        """
        self._check_idle("drop_masked_pages")
        ps = self.model.page_size
        drop = masked_full_pages(self.masked[: self.kv_len], ps)
        if not drop:
            return 0
        idx = [i for i in range(len(self.tokens)) if i >= self.kv_len or i // ps not in drop]
        self.tokens = [self.tokens[i] for i in idx]
        self.positions = [self.positions[i] for i in idx]
        self.masked = [self.masked[i] for i in idx]
        PAGES.release([self.pages[j] for j in drop])
        self.pages = [p for j, p in enumerate(self.pages) if j not in drop]
        self.kv_len -= ps * len(drop)
        return len(drop)

    def export(self, name: str, persistent: bool = False) -> None:
        """Share this context's KV under `name` (pending tokens included in the history).

        The partial last page is exported as a copy, so this context can go on writing its own.
        """
        self._check_idle("export")
        export_context(self, name, persistent)

    @classmethod
    def import_(cls, name: str, model: Model | None = None) -> Context:
        """A context continuing a context exported under `name` (KeyError when there is none)."""
        return import_context(cls(model), name)

    @staticmethod
    def unexport(name: str) -> None:
        """Remove an exported name (KeyError when unknown)."""
        unexport(name)

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
        self._masked.extend([False] * n)
        self.next_pos += n

    def _spec(self, sampler: Sampler | None, dist: int) -> Any:
        """The output spec for the last pending token of a pass over all pending tokens."""
        if self._slots:  # (their pass runs first: the spec's index counts from after it)
            self._run_slots()
        self._attach_if_fresh(len(self.tokens))
        index = len(self.tokens) - self.kv_len - 1
        return _host.forward.OutputSpec(
            index=index, sample=None if sampler is None else sampler.to_wit(), dist=dist
        )

    def _attach_if_fresh(self, hi: int) -> None:
        """Before the first pass over tokens[:hi] (nothing in the KV yet): start from the host's
        cached pages for the longest full-page prefix of tokens[:hi - 1] (one token stays to run).
        Called before anything depends on `kv_len` (the output spec's index, the pass geometry)."""
        # Once only: asked again within the same pass (the output spec, then the geometry), the
        # cache may by then hold pages another instance just wrote, and the pass would no longer
        # match the spec computed from the first answer.
        if (self.kv_len == 0 and self.prefix_cache and hi > self.model.page_size and not self.pages
                and not self._attach_tried):
            self._attach_tried = True
            self._attach_cached_prefix(hi - 1)

    def _attach_cached_prefix(self, limit: int) -> None:
        """Start from the host's cached pages for tokens[:limit] (standard positions, nothing masked)."""
        if True in self.masked[:limit] or self.positions[:limit] != list(range(limit)):
            return
        pages = list(_host.kv.attach_prefix(self.tokens[:limit]))
        if pages:
            PAGES.adopt(pages)
            self.pages = pages
            self.kv_len = len(pages) * self.model.page_size

    def _run_slots(self) -> None:
        """Run every pending token but the last in one `embed.run` pass with the pending slots' vectors
        on their placeholders, then release the slots."""
        last = max(i + len(s) for i, s in self._slots.items())
        if last > len(self.tokens) - 1:
            raise ValueError("Context: an image (or slot) is the last pending input: fill text after it "
                             "before generating")
        if self._n_masked:
            raise ValueError("Context: a masked context takes no images or slots")
        first = min(self._slots)
        if self.kv_len == 0 and not self._attach_tried and first > 0:
            self._attach_if_fresh(first + 1)  # a cached prefix, before the first vectors only
        self._attach_tried = True
        slots, self._slots = self._slots, {}
        lo = self.kv_len
        pages, last_len, tokens, positions, _mask = self._prepare(len(self.tokens) - lo - 1)
        try:
            _host.embed.run(pages, last_len, tokens, positions, [(i - lo, s.handle) for i, s in slots.items()], [])
        finally:
            for s in slots.values():
                s.release()

    def _prepare_all(self, call: str) -> tuple[list[int], int, list[int], list[int], list[list[int]]]:
        n = len(self.tokens) - self.kv_len
        if n == 0:
            raise RuntimeError(f"Context.{call}: no pending token to run (fill or decode first)")
        return self._prepare(n)

    def _prepare(self, n: int) -> tuple[list[int], int, list[int], list[int], list[list[int]]]:
        """Pages, last-page length, tokens, positions and mask for the next `n` pending tokens.

        Allocates the pages they need and counts them as written (the pass is being submitted).
        """
        if self._slots:  # pending vectors run first, in a pass of their own (embed.run)
            before = self.kv_len
            self._run_slots()
            n -= self.kv_len - before
        ps = self.model.page_size
        hi = self.kv_len + n
        self._attach_if_fresh(hi)
        lo = self.kv_len
        need = -(-hi // ps) - len(self.pages)
        if need > 0:
            self.pages.extend(PAGES.allocate(need))
        mask = pass_rows(self._masked[:lo], self._masked[lo:hi]) if self._n_masked else []
        self.kv_len = hi
        return self.pages, hi - (len(self.pages) - 1) * ps, self.tokens[lo:hi], self.positions[lo:hi], mask
