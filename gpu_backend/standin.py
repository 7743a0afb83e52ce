"""A stand-in backend with no model: implements `gpu_backend.types.Backend`.

Its "model" is deterministic: the sampled token after token t is (t + 1) % vocab, so an
inferlet's output is predictable and any cross-talk between instances shows up. `delay_s`
makes each batch take that long in all, as a GPU step does: its own bookkeeping (a few us per
request) runs first and the rest of the time is slept with the GIL released, so a batch of any
size costs the host exactly `delay_s` of backend time. `token_s` adds that much per new token in the
batch (a fixed time plus a time per token, as a prefill costs on a device: bench/qos.py). The host benchmarks put it behind the real
host to measure the host alone. Tests use it through tests/fakes.py.

The sleeping thread asks Linux for a timer slack of 1 us (`prctl(PR_SET_TIMERSLACK)`): with the
default 50 us, `time.sleep(0.01)` returned ~96 us late (median, measured on the 2-core dev VM;
~45 us with 1 us slack), so a "10 ms" step took 10.1 ms and a "2 ms" one 2.1 ms, which counted
against the host. A GPU step waited for with `cudaStreamSynchronize` (a spin by default) has
no such slack.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gpu_backend.types import Feed, ForwardRequest, OutputResult
from gpu_backend.validate import check_batch

__all__ = ["StandInBackend", "StandInInfo", "StandInStep", "StandInTokenizer"]


@dataclass(frozen=True)
class StandInInfo:
    name: str = "stand-in"
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
    hidden_size: int = 4  # a hidden state: [token, position, sum of the sequence's tokens, 1] (see forward)
    image_token_id: int | None = 250  # `embed_image`: an image is 3 vectors (see there)
    image_tokens: int = 3
    matryoshka: list[int] | None = None  # widths an embedding may be cut to (ModelInfo.matryoshka)


class StandInTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(text.encode("latin-1", "replace"))

    def encode_prompt(self, text: str) -> list[int]:
        return self.encode(text)  # no BOS: the stand-in's tokenizer adds none

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("latin-1")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


_PR_SET_TIMERSLACK = 29
_slack_set = threading.local()


def _fine_timer_slack() -> None:
    """1 us timer slack for the calling thread (Linux; elsewhere nothing), once per thread."""
    if getattr(_slack_set, "done", False):
        return
    _slack_set.done = True
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
        except (OSError, AttributeError):  # no libc prctl: the default slack stays
            pass


class StandInStep:
    """A started stand-in batch (`StandInBackend.start_forward`)."""

    __slots__ = ("outputs", "tokens", "_until")

    def __init__(self, outputs: list[list[OutputResult]], until: float) -> None:
        self.outputs = outputs  # computed when the batch started (a subclass may change them there)
        # each request's first output's token (None if it samples none or has none), as a GPU
        # backend has them in one tensor: the scheduler reads these instead of two objects per row.
        # Made in `wait()` before it sleeps: within the batch's time, as a GPU makes them.
        self.tokens: list[int | None] = []
        self._until = until

    def wait(self) -> list[list[OutputResult]]:
        """The batch's outputs, once its time (from `start_forward`'s call) has passed."""
        self.tokens = [r[0].token if r else None for r in self.outputs]
        if self._until:
            _fine_timer_slack()
            time.sleep(max(self._until - time.perf_counter(), 0.0))
        return self.outputs


class StandInBackend:
    """Deterministic tokens, optional sleep per batch; records batch sizes and slot contents."""

    feeds = True  # start_forward takes a `Feed` (as the torch backend's)

    def __init__(self, page_size: int = 4, num_pages: int = 64, delay_s: float = 0.0, token_s: float = 0.0) -> None:
        self.info = StandInInfo(page_size=page_size, num_pages=num_pages)
        self.tokenizer = StandInTokenizer()
        self.delay_s = delay_s
        self.token_s = token_s
        self.batches: list[int] = []
        self._free_at = 0.0  # when the "device" is done with the batches started so far
        self._lock = threading.Lock()
        # the "KV cache": the token stored in each slot, so reads of foreign pages are detectable
        self.slots: dict[tuple[int, int], int] = {}

    def forward(self, reqs: Sequence[ForwardRequest]) -> list[list[OutputResult]]:
        return self.start_forward(reqs).wait()

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> StandInStep:
        """Start a batch as a GPU does: read the requests and "enqueue" it (its outputs are computed
        now, deterministically), return at once; `wait()` returns `delay_s` after the call, or after
        the batches started before it are done, as a device runs its queue. Invalid requests
        raise ForwardError here, as `forward` does. `feed`: the fed requests' token is the one
        drawn by `feed.source`'s row (a `StandInStep` of this backend)."""
        start = time.perf_counter()
        reqs = check_batch(reqs, self.info)  # the real validator: same errors as the model
        ps = self.info.page_size
        fed: dict[int, int] = {}
        if feed is not None:
            src: list[list[OutputResult]] = feed.source.outputs  # type: ignore[attr-defined]
            for i, j in zip(feed.requests, feed.rows, strict=True):
                if not 0 <= i < len(reqs) or len(reqs[i].tokens) != 1 or not 0 <= j < len(src) or not src[j] \
                        or src[j][0].token is None:
                    raise ValueError(f"Feed: request {i} / row {j} cannot be fed")
                fed[i] = src[j][0].token  # type: ignore[assignment]
        out = []
        with self._lock:
            self.batches.append(len(reqs))
            for i, r in enumerate(reqs):
                tokens = [fed[i]] if i in fed else list(r.tokens)
                for start, data in r.embeds or ():  # an input vector acts as the token its first value rounds to
                    vecs = np.frombuffer(data, dtype="<f4").reshape(-1, self.info.hidden_size)
                    for k, v in enumerate(vecs):
                        tokens[start + k] = int(round(float(v[0]))) % self.info.vocab_size
                ctx = r.context_len(ps)
                for j, t in enumerate(tokens):
                    slot = ctx + j
                    self.slots[(r.pages[slot // ps], slot % ps)] = t
                res = []
                for o in r.outputs:
                    nxt = (tokens[o.index] + 1) % self.info.vocab_size
                    res.append(OutputResult(token=nxt if o.sample else None, ids=[nxt][: o.dist],
                                            probs=[1.0][: o.dist],  # its one token has probability 1
                                            logprob=None if o.target is None else 0.0 if o.target == nxt else -100.0,
                                            hidden=self._hidden(r, ctx, o.index, tokens) if o.hidden else None))
                out.append(res)
            until = 0.0
            cost = self.delay_s + (self.token_s * sum(len(r.tokens) for r in reqs) if self.token_s else 0.0)
            if cost:
                until = self._free_at = max(start, self._free_at) + cost
        return StandInStep(out, until)

    def input_embeddings(self, tokens: Sequence[int]) -> bytes:
        """The stand-in's embedding of a token: [token, 0, 0, 0] (fed back, it acts as that token)."""
        return np.asarray([[t, 0, 0, 0] for t in tokens], dtype="<f4").tobytes()

    def embed_image(self, data: bytes, media_type: str) -> bytes:
        """The stand-in's "vision tower": 3 vectors acting as the tokens of the image's first three
        bytes (so a test can tell which image a pass read); ValueError for empty bytes."""
        if len(data) < 3:
            raise ValueError("the image does not decode (the stand-in needs at least 3 bytes)")
        return self.input_embeddings([b % self.info.vocab_size for b in data[:3]])

    def _hidden(self, r: ForwardRequest, ctx: int, index: int, tokens: list[int]) -> bytes:
        """The stand-in's hidden state of row `index`: its token, its position, the sum of the tokens
        in the slots it attends to (causal) and 1: the sequence's content, so a test can tell that
        the context was read (lock held)."""
        ps = self.info.page_size
        seen = sum(self.slots.get((r.pages[s // ps], s % ps), 0) for s in range(ctx + index + 1))
        return np.asarray([tokens[index], r.positions[index], seen, 1.0], dtype="<f4").tobytes()

    @property
    def swap_page_bytes(self) -> int:
        """What a swapped page "takes" (`gpu_backend.types.SwapsPages`): 8 bytes a slot."""
        return 8 * self.info.page_size

    def swap_out(self, pages: Sequence[int]) -> list[list[int]]:
        """The tokens stored in `pages`' slots (-1: never written)."""
        ps = self.info.page_size
        with self._lock:
            return [[self.slots.get((p, i), -1) for i in range(ps)] for p in pages]

    def swap_in(self, swapped: object, pages: Sequence[int]) -> None:
        assert isinstance(swapped, list) and len(swapped) == len(pages)
        with self._lock:
            for p, slots in zip(pages, swapped, strict=True):
                for i, t in enumerate(slots):
                    if t < 0:
                        self.slots.pop((p, i), None)
                    else:
                        self.slots[(p, i)] = t

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        for i in range(count):
            self.slots[(dst_page, dst_offset + i)] = self.slots.get((src_page, src_offset + i), -1)
