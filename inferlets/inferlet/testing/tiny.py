"""`TinyBackend`: a deterministic toy model behind `gpu_backend.types.Backend`, for CPU tests.

Tokens are UTF-8 bytes: id = byte + 3; ids 0-2 are the specials <s>, </s>, <|im_end|>.
The KV cache holds the (token, position) pair written into each slot. The token an output row
samples is a function of every pair that row attends to, in order (see `next_token`), so a wrong
page, length, position or mask changes the output.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpu_backend.types import ForwardError, ForwardRequest, OutputResult
from gpu_backend.validate import check_batch

__all__ = ["SPECIALS", "VOCAB", "ByteTokenizer", "TinyBackend", "TinyInfo", "next_token"]

SPECIALS = ["<s>", "</s>", "<|im_end|>"]
_OFFSET = len(SPECIALS)
VOCAB = 256 + _OFFSET

Slot = tuple[int, int]  # (token, position) written by a forward pass


@dataclass(frozen=True)
class TinyInfo:
    """The toy model's `gpu_backend.types.BackendInfo`."""

    page_size: int = 4
    num_pages: int = 64
    name: str = "fake"
    vocab_size: int = VOCAB
    stop_tokens: list[int] = field(default_factory=lambda: [1, 2])
    chat_template: str = "chatml"
    max_position: int = 0  # not known: any position below 2**32


class ByteTokenizer:
    """UTF-8 bytes offset by the specials, which are recognised verbatim in text. `add_bos`: a raw
    prompt starts with <s> (as a Llama 2 tokenizer's does); off unless a test turns it on."""

    add_bos = False

    def encode(self, text: str) -> list[int]:
        """Text -> ids; each special string becomes its one id."""
        ids: list[int] = []
        while text:
            special = next((i for i, s in enumerate(SPECIALS) if text.startswith(s)), None)
            if special is not None:
                ids.append(special)
                text = text[len(SPECIALS[special]) :]
            else:
                ids.extend(b + _OFFSET for b in text[0].encode())
                text = text[1:]
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """`encode`, after <s> when `add_bos`."""
        return [0, *self.encode(text)] if self.add_bos else self.encode(text)

    def decode(self, ids: list[int]) -> str:
        """Ids -> text; like the real host, an incomplete UTF-8 sequence at the end is dropped."""
        out, buf = [], bytearray()
        for t in ids:
            if t < _OFFSET:
                out.append(buf.decode(errors="replace") + SPECIALS[t])
                buf.clear()
            else:
                buf.append(t - _OFFSET)
        for cut in range(len(buf), max(len(buf) - 4, -1), -1):
            try:
                out.append(buf[:cut].decode())
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(buf.decode(errors="replace"))
        return "".join(out)

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """A ChatML-like rendering with <s> for <|im_start|>."""
        text = "".join(f"<s>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<s>assistant\n" if add_generation_prompt else "")


def next_token(visible: Sequence[Slot]) -> int:
    """The toy model: a lowercase-letter byte token determined by the attended (token, position)s.

    acc = 7, then acc = (acc * 31 + token * 7 + position) % 1_000_003 for each pair in order;
    the token is the byte ord("a") + acc % 26.
    """
    acc = 7
    for tok, pos in visible:
        acc = (acc * 31 + tok * 7 + pos) % 1_000_003
    return _OFFSET + ord("a") + acc % 26


def _attended(seq: list[Slot], row: list[int] | None) -> list[Slot]:
    """The slots of `seq` a BRLE mask row attends to (all of them without a mask)."""
    if row is None:
        return seq
    out, j = [], 0
    for r, n in enumerate(row):
        if r % 2 == 0:
            out.extend(seq[j : j + n])
        j += n
    return out


class TinyBackend:
    """The toy model with a paged KV cache of (token, position) slots.

    `slots[page][offset]` is what a pass or copy wrote there, None when nothing did since the page
    was `erase`d; reading such a slot fails the request. While `script` is non-empty, each sampled
    output takes its token from the front of it instead of `next_token`. The `dist` most probable
    ids of a row are token, token + 1, ... (mod vocab) with probabilities 0.5 / (k + 1).
    """

    def __init__(self, page_size: int = 4, num_pages: int = 64) -> None:
        self.info = TinyInfo(page_size=page_size, num_pages=num_pages)
        self.tokenizer = ByteTokenizer()
        self.slots: dict[int, list[Slot | None]] = {}
        self.script: list[int] = []

    def erase(self, pages: Sequence[int]) -> None:
        """Mark every slot of `pages` unwritten (the host does it when it hands pages out)."""
        for p in pages:
            self.slots[p] = [None] * self.info.page_size

    def forward(self, reqs: Sequence[ForwardRequest]) -> list[list[OutputResult]]:
        """Validate every request, then write each one's slots and compute its outputs, in order."""
        checked = check_batch(reqs, self.info)
        for i, r in enumerate(checked):
            self._check_written(i, r)
        return [self._run(r) for r in checked]

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        """Copy `count` slots from `src_page[src_offset:]` to `dst_page[dst_offset:]`."""
        ps = self.info.page_size
        src = self.slots.get(src_page, [None] * ps)[src_offset : src_offset + count]
        self.slots.setdefault(dst_page, [None] * ps)[dst_offset : dst_offset + count] = src

    def _slot(self, page: int, offset: int) -> Slot | None:
        return self.slots.get(page, [None] * self.info.page_size)[offset]

    def _check_written(self, index: int, req: ForwardRequest) -> None:
        """The context a pass reads must have been written (its own new tokens are written by it)."""
        ps = self.info.page_size
        for j in range(req.context_len(ps)):
            if self._slot(req.pages[j // ps], j % ps) is None:
                raise ForwardError(index, f"slot {j} of the sequence was never written")

    def _run(self, req: ForwardRequest) -> list[OutputResult]:
        ps, ctx = self.info.page_size, req.context_len(self.info.page_size)
        for i, slot in enumerate(zip(req.tokens, req.positions, strict=True)):
            page = req.pages[(ctx + i) // ps]
            self.slots.setdefault(page, [None] * ps)[(ctx + i) % ps] = slot
        seq = [self._slot(req.pages[j // ps], j % ps) for j in range(req.total_len(ps))]
        results = []
        for spec in req.outputs:
            row = None if req.mask is None else req.mask[spec.index]
            visible = _attended(seq[: ctx + spec.index + 1], row)  # type: ignore[arg-type]  # all written
            token = self.script.pop(0) if self.script and spec.sample else next_token(visible)
            ids = [(token + k) % self.info.vocab_size for k in range(spec.dist)]
            probs = [0.5 / (k + 1) for k in range(spec.dist)]
            res = OutputResult(token if spec.sample is not None else None, ids, probs)
            if spec.target is not None:  # the same made-up distribution: token + k has p = 0.5 / (k + 1)
                res.logprob = math.log(0.5 / ((spec.target - token) % self.info.vocab_size + 1))
            results.append(res)
        return results
