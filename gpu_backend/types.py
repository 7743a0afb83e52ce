"""The batch format shared by the host and the backend, and the `Backend` protocol.

Plain dataclasses of ints/floats/lists so a batch can later cross a socket to a remote
backend process. A request is validated once, where it enters (a WIT import in the host, or
`Backend.forward` for a direct caller): `gpu_backend.validate.check_request` marks it
`checked`, and a backend does not check a checked request again.
Light on purpose: importing this module does not load torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplerParams:
    """How to draw one token. temperature == 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    min_p: float = 0.0  # 0 = no min-p filter
    seed: int | None = None  # same seed + same distribution -> same token, whatever the batch


@dataclass(frozen=True)
class OutputSpec:
    """One output row of a request: `index` is a position in the request's new tokens."""

    index: int
    sample: SamplerParams | None = None
    dist: int = 0  # return the `dist` most probable (id, prob) pairs; 0 = none
    # None = every token; else the tokens this row may produce, a packed bitmask of ceil(vocab / 32)
    # little-endian int32 words (bit t % 32 of word t // 32 = token t), as `gpu_backend.grammar` fills.
    # Applied to the logits before the sampler's filters and `dist`.
    allowed: bytes | None = None
    # Score this token: its log-probability at temperature 1 over the whole vocabulary (before
    # `allowed` and any filter) comes back as `OutputResult.logprob` (prompt logprobs, WIT run-scored).
    target: int | None = None
    # Return this row's hidden state: the last layer's output after the final norm, float32, as
    # `OutputResult.hidden` (embeddings: a decoder embedding model pools these).
    hidden: bool = False


@dataclass
class ForwardRequest:
    """Append `tokens` to the sequence held in `pages` and compute the requested outputs.

    pages: all pages of the sequence, new tokens included, in order.
    last_page_len: valid slots in the last page *after* this pass (1..page_size).
        Context before the pass = (len(pages)-1)*page_size + last_page_len - len(tokens);
        the new tokens' K/V are written at the slots right after it.
    positions: one RoPE position per new token.
    mask: None (causal) or one BRLE row per new token: run lengths alternating attend /
        masked starting with attend; row i covers context + tokens[0..=i] (its run lengths
        sum to context_len + i + 1).
    """

    pages: list[int]
    last_page_len: int
    tokens: list[int]
    positions: list[int]
    mask: list[list[int]] | None = None
    outputs: list[OutputSpec] = field(default_factory=list)
    name: str = ""  # who asked (instance id), used in error messages
    # Input embeddings in place of some tokens (an image's features): (start index into `tokens`,
    # float32 little-endian bytes of [n, hidden_size]) runs, not overlapping; the embedding of the
    # tokens there (placeholders) is replaced by these vectors, after the model's embedding scale.
    embeds: list[tuple[int, bytes]] | None = None
    # set by validate.check_request; a checked request is not validated again downstream
    checked: bool = field(default=False, compare=False, repr=False)

    # The geometry of a pass, in one place.
    def total_len(self, page_size: int) -> int:
        """Tokens in the sequence after this pass: full pages plus the last page's length."""
        return (len(self.pages) - 1) * page_size + self.last_page_len

    def context_len(self, page_size: int) -> int:
        """Tokens already in the pages before this pass (what the new tokens attend to)."""
        return self.total_len(page_size) - len(self.tokens)

    def first_written_page(self, page_size: int) -> int:
        """Index into `pages` of the first page this pass writes; pages before it are only read."""
        return self.context_len(page_size) // page_size


@dataclass
class OutputResult:
    """Answer for one OutputSpec, same order as the request's outputs."""

    token: int | None = None
    ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    logprob: float | None = None  # the spec's `target`'s log-probability (None without a target)
    hidden: bytes | None = None  # float32 [hidden_size] when the spec asked for `hidden`


class ForwardError(ValueError):
    """A request in a batch is invalid; the message names the request and the bad value."""

    def __init__(self, request_index: int, message: str) -> None:
        super().__init__(message)
        self.request_index = request_index


@runtime_checkable
class BackendInfo(Protocol):
    """What the host needs to know about a loaded model (`gpu_backend.ModelInfo` has it all)."""

    @property
    def name(self) -> str: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_pages(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def stop_tokens(self) -> list[int]: ...
    @property
    def chat_template(self) -> str: ...
    @property
    def max_position(self) -> int:
        """0 = not known."""
        ...


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]:
        """`encode` of a raw prompt, after BOS where the tokenizer adds one (as transformers' `tokenizer(text)`)."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


@runtime_checkable
class Backend(Protocol):
    """A model with a paged KV cache: what the host drives. Page ids are ints in [0, info.num_pages),
    owned by the caller (the host's page manager).

    Implemented by `gpu_backend.TorchBackend`, `tests/fakes.FakeBackend` and the SDK's
    `inferlet.testing.TinyBackend`.
    """

    @property
    def info(self) -> BackendInfo: ...
    @property
    def tokenizer(self) -> Tokenizer: ...

    def forward(self, reqs: Sequence[ForwardRequest]) -> list[list[OutputResult]]:
        """Run one batched pass: append each request's tokens' K/V into its pages and compute its outputs.

        Validates each request not yet `checked`; raises ForwardError naming the first bad one
        (`request_index`) before touching the cache. Returns, per request, one OutputResult per
        OutputSpec, in order.
        """
        ...

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        """Copy the K/V of `count` tokens from `src_page[src_offset:]` to `dst_page[dst_offset:]`."""
        ...


class StartedForward(Protocol):
    """A batch a backend has started (`start_forward`, optional): `wait()` returns its outputs."""

    def wait(self) -> list[list[OutputResult]]: ...

    # optional: `tokens`, each request's first output's token (None where none is sampled), read
    # after `wait()`: the scheduler takes the loops' next tokens from it (one list, not two objects per row)


class Feed:
    """Requests of a batch whose one new token is the token an earlier started batch (`source`, from
    the same backend's `start_forward`) draws, read where it is drawn (on the device) instead of by
    the host: `requests[k]` takes the first output's token of `source`'s request `rows[k]` (their
    own `tokens` hold a placeholder). A backend that takes it says so with `feeds = True`."""

    __slots__ = ("source", "requests", "rows")

    def __init__(self, source: StartedForward, requests: Sequence[int], rows: Sequence[int]) -> None:
        if len(requests) != len(rows):
            raise ValueError("Feed: requests and rows differ in length")
        self.source, self.requests, self.rows = source, list(requests), list(rows)


class Started:
    """A batch that has already run: what `started(backend.forward(reqs))` gives a backend that cannot
    overlap, so every backend has `start_forward`'s shape (the scheduler has one run path)."""

    __slots__ = ("outputs", "tokens")

    def __init__(self, outputs: list[list[OutputResult]]) -> None:
        self.outputs = outputs
        self.tokens: list[int | None] = [r[0].token if r else None for r in outputs]

    def wait(self) -> list[list[OutputResult]]:
        return self.outputs


def started(outputs: list[list[OutputResult]]) -> Started:
    return Started(outputs)


# An overlapping backend also has `start_forward(reqs, feed=None) -> StartedForward`, as a GPU runs a batch:
# it validates (raising ForwardError as `forward` does) and reads every request before it
# returns, runs its calls in the order they are made, and the batch's time passes while the host
# goes on. The scheduler then prepares the next batch while this one runs (host/batching/
# scheduler.py, "ahead"). One with `feeds = True` takes a `Feed`: the scheduler then launches the
# loops' next batch before it waits for the last (its tokens read on the device). The torch backend
# and `gpu_backend.standin.StandInBackend` have both; a backend whose `forward` computes
# synchronously gains nothing from them and leaves them out.


@runtime_checkable
class SwapsPages(Protocol):
    """Optional backend capability: copy pages' K/V out to host memory and back (the host suspends
    an instance under KV pressure with it: host/suspend.py). A backend without it (or with
    `swap_page_bytes` 0: engine processes of tensor-parallel ranks) cannot suspend instances; the
    host then fails an instance that waits for pages nobody will free with `out_of_resources`,
    naming why. The engine-process client keeps the copies in the engine process.

    Both run on the scheduler thread between batches (`Scheduler.call`), after every batch started
    before them and before any started after: no page moves under a running forward.
    """

    swap_page_bytes: int  # host memory one swapped page takes; 0: this backend cannot swap after all

    def swap_out(self, pages: Sequence[int]) -> object:
        """A host-memory copy of `pages`' K/V (the pages themselves are left as they are)."""
        ...

    def swap_in(self, swapped: object, pages: Sequence[int]) -> None:
        """Write a `swap_out` copy back into `pages` (as many, in the same order; any free pages)."""
        ...
