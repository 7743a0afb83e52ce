"""A tiny stand-in backend for fast host tests (no model): same interface as gpu_backend.Backend.

Its "model" is deterministic: the sampled token after token t is (t + 1) % vocab, so an
inferlet's output is predictable and any cross-talk between instances shows up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from gpu_backend.types import ForwardError, ForwardRequest, OutputResult


@dataclass(frozen=True)
class FakeInfo:
    name: str = "fake-model"
    page_size: int = 4
    num_pages: int = 64
    vocab_size: int = 256
    stop_tokens: list[int] = field(default_factory=lambda: [0])
    chat_template: str = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    bos_token_id: int = 1
    eos_token_id: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_position: int = 8192


class FakeTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1", "replace"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


class FakeBackend:
    def __init__(self, page_size: int = 4, num_pages: int = 64, delay_s: float = 0.0) -> None:
        self.info = FakeInfo(page_size=page_size, num_pages=num_pages)
        self.tokenizer = FakeTokenizer()
        self.delay_s = delay_s
        self.batches: list[int] = []
        self.fail_next = False
        self._lock = threading.Lock()
        # the "KV cache": the token stored in each slot, so reads of foreign pages are detectable
        self.slots: dict[tuple[int, int], int] = {}

    def check_request(self, req: ForwardRequest) -> None:
        ps = self.info.page_size
        for p in req.pages:
            if not 0 <= p < self.info.num_pages:
                raise ValueError(f"{req.name}: page {p} out of range")
        if len(req.positions) != len(req.tokens):
            raise ValueError(f"{req.name}: {len(req.positions)} positions for {len(req.tokens)} tokens")
        ctx = (len(req.pages) - 1) * ps + req.last_page_len - len(req.tokens)
        if req.mask is not None:
            if len(req.mask) != len(req.tokens):
                raise ValueError(f"{req.name}: {len(req.mask)} mask rows for {len(req.tokens)} tokens")
            for i, row in enumerate(req.mask):
                if sum(row) != ctx + i + 1:
                    raise ValueError(f"{req.name}: mask row {i} covers {sum(row)} tokens, expected {ctx + i + 1}")
        for o in req.outputs:
            if not 0 <= o.index < len(req.tokens):
                raise ValueError(f"{req.name}: output index {o.index} out of range")

    def forward(self, reqs: list[ForwardRequest]) -> list[list[OutputResult]]:
        for i, r in enumerate(reqs):
            try:
                self.check_request(r)
            except ValueError as e:
                raise ForwardError(i, str(e)) from None
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected backend failure")
        if self.delay_s:
            time.sleep(self.delay_s)
        ps = self.info.page_size
        out = []
        with self._lock:
            self.batches.append(len(reqs))
            for r in reqs:
                total = (len(r.pages) - 1) * ps + r.last_page_len
                ctx = total - len(r.tokens)
                for j, t in enumerate(r.tokens):
                    slot = ctx + j
                    self.slots[(r.pages[slot // ps], slot % ps)] = t
                res = []
                for o in r.outputs:
                    nxt = (r.tokens[o.index] + 1) % self.info.vocab_size
                    res.append(OutputResult(token=nxt if o.sample else None,
                                            ids=[nxt][: o.dist], probs=[1.0][: o.dist]))
                out.append(res)
        return out

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        for i in range(count):
            self.slots[(dst_page, dst_offset + i)] = self.slots.get((src_page, src_offset + i), -1)
