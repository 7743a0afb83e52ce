"""`TorchBackend`: a loaded model with its paged KV cache, running batched forward passes (`forward`,
`start_forward` with `Feed`), and its own loop (`generate_batch`, gpu_backend/generate.py). Built by
gpu_backend/build.py."""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from itertools import accumulate
from typing import TypeVar

import numpy as np
import torch

from gpu_backend.attention import Attention, BatchPlan, SdpaAttention, build_plan, to_device, write_slots
from gpu_backend.cuda_graphs import DecodeGraphs
from gpu_backend.generate import GREEDY, generate_batch
from gpu_backend.kv_cache import KVCache
from gpu_backend.loading.tokenizer import Tokenizer
from gpu_backend.models.config import ModelInfo
from gpu_backend.models.llama import LlamaModel
from gpu_backend.models.vision import VisionTower
from gpu_backend.sampling import Drawn, SampleError, Sampler
from gpu_backend.types import Feed, ForwardError, ForwardRequest, OutputResult, SamplerParams
from gpu_backend.validate import check_batch, check_request

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class _FedPlan:
    """A checked `Feed` into a batch: where its tokens go in the batch's token list."""

    __slots__ = ("feed", "dst")

    def __init__(self, feed: Feed, reqs: list[ForwardRequest]) -> None:
        """Raise ValueError unless every fed request has one new token and every row draws one."""
        src = feed.source._reqs  # type: ignore[attr-defined]  # a TorchStep (or a wrapper of one)
        offsets = list(accumulate((len(r.tokens) for r in reqs), initial=0))
        for i, j in zip(feed.requests, feed.rows, strict=True):
            if not 0 <= i < len(reqs) or len(reqs[i].tokens) != 1:
                raise ValueError(f"Feed: request {i} is not a one-token request of the batch")
            if not 0 <= j < len(src) or not src[j].outputs or src[j].outputs[0].sample is None:
                raise ValueError(f"Feed: row {j} of the source batch draws no token")
        self.feed, self.dst = feed, [offsets[i] for i in feed.requests]

    def patch(self, plan: BatchPlan) -> None:
        """Write the fed tokens into `plan.tokens` on the device (queued behind the source batch)."""
        source = self.feed.source
        drawn = source._device_tokens  # type: ignore[attr-defined]
        if drawn is None:
            raise RuntimeError("Feed: the source batch has not drawn its tokens (started on another backend?)")
        out_rows = list(accumulate((len(r.outputs) for r in source._reqs), initial=0))  # type: ignore[attr-defined]
        dst = to_device(np.asarray(self.dst, dtype=np.int64), plan.tokens.device)
        sel = to_device(np.asarray([out_rows[j] for j in self.feed.rows], dtype=np.int64), drawn.device)
        plan.tokens.index_copy_(0, dst, drawn.index_select(0, sel))


class TorchStep:
    """A batch started by `TorchBackend.start_forward` (a `gpu_backend.types.StartedForward`)."""

    __slots__ = ("tokens", "_backend", "_reqs", "_drawn", "_future", "_out", "_device_tokens")

    def __init__(self, backend: TorchBackend, reqs: list[ForwardRequest], drawn: Drawn | None,
                 future: Future[list[list[OutputResult]]] | None) -> None:
        self._backend, self._reqs, self._drawn, self._future = backend, reqs, drawn, future
        self._out: list[list[OutputResult]] | None = None
        # each request's first output's token (None where it samples none), set by `wait()`
        self.tokens: list[int | None] = []
        # the drawn tokens on the device, one per output row (set at the launch: on CPU by the worker)
        self._device_tokens: torch.Tensor | None = None if drawn is None else drawn.tokens


    def wait(self) -> list[list[OutputResult]]:
        """The batch's outputs, once it has run (ForwardError if a row could not be drawn)."""
        if self._out is None:
            if self._future is not None:
                out = self._future.result()
            else:
                out = self._backend._results(self._reqs, self._drawn)
            self._out = out
            self.tokens = [r[0].token if r else None for r in out]
        return self._out



class TorchBackend:
    """A loaded model with its KV cache (implements `gpu_backend.types.Backend`).

    Page ids are plain ints in [0, num_pages), owned by the caller. `attention`: how a batch attends
    over the pages (SDPA over gathered pages when None); `graphs`: decode batches it accepts replay
    its CUDA graphs (None = all eager)."""

    def __init__(self, model: LlamaModel, tokenizer: Tokenizer, info: ModelInfo, cache: KVCache,
                 attention: Attention | None = None, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.info = info
        self.cache = cache
        self.attention = attention if attention is not None else SdpaAttention()
        self.graphs = graphs
        self.sampler = Sampler(model.device)
        # forward / copy_tokens / logits may come from different host threads; the cache and the
        # sampler's generator are shared state, so they run one at a time
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # CPU: where start_forward's batches run
        self.feeds = True  # start_forward takes a Feed (tensor parallel does not)
        self.vision: VisionTower | None = None  # a LLaVA's vision side, set by build.py (gpu_backend/images.py)

    # -- validation ---------------------------------------------------------------------------

    def check_request(self, req: ForwardRequest) -> ForwardRequest:
        """Raise ValueError (naming `req.name` and the bad value) if `req` is invalid; else return it
        normalised and marked checked. Cheap."""
        return check_request(req, self.info)

    # -- forward ------------------------------------------------------------------------------

    def forward(self, reqs: Sequence[ForwardRequest]) -> list[list[OutputResult]]:
        """Validate every request not yet checked, then run one batched forward pass for all of them.

        Raises ForwardError (with `request_index`) before touching the cache if any request is
        invalid. Returns, per request, one OutputResult per OutputSpec in order.
        """
        if not reqs:
            return []
        checked = check_batch(reqs, self.info)
        self._check_write_conflicts(checked)
        return self._in_order(lambda: self._results(checked, self._launch(checked)))

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> TorchStep:
        """`forward`, overlapping the caller: validate (raising ForwardError as `forward` does) and read
        the requests, start the batch, return at once; `wait()` on the result returns the outputs.

        On CUDA the batch's kernels (and its draws) are queued on the device's current stream with no
        host sync, the sampled tokens copied back behind them into pinned memory: the host prepares
        the next batch while this one runs. On CPU the batch runs on the backend's worker thread
        (one for the backend: every later call, `copy_tokens` included, runs after it). Calls run
        in the order they are made. A batch whose draw fails (non-finite logits) fails at `wait()`.

        `feed`: requests whose one new token is the token an earlier started batch draws, read on
        the device (their `tokens` hold a placeholder): the next decode step is launched before the
        host has seen the last one's token, and the device never waits for the host between steps.
        """
        checked = check_batch(reqs, self.info) if reqs else []
        self._check_write_conflicts(checked)
        if not checked:
            return TorchStep(self, [], None, None)
        fed = _FedPlan(feed, checked) if feed is not None else None
        if self.model.device.type == "cuda":
            return TorchStep(self, checked, self._launch(checked, fed), None)
        # the worker reads the requests later: give it copies (the caller may change them at once)
        snap = [replace(r, pages=list(r.pages), tokens=list(r.tokens), positions=list(r.positions),
                        outputs=list(r.outputs), embeds=None if r.embeds is None else list(r.embeds)) for r in checked]
        step = TorchStep(self, snap, None, None)

        def run() -> list[list[OutputResult]]:
            drawn = self._launch(snap, fed)
            step._device_tokens = None if drawn is None else drawn.tokens
            return self._results(snap, drawn)

        step._future = self._worker().submit(run)
        return step

    def _launch(self, checked: list[ForwardRequest], fed: _FedPlan | None = None) -> Drawn | None:
        """Queue one pass and its draws (on CUDA without a host sync); None if nothing is drawn."""
        with self._lock, torch.inference_mode():
            specs = [o for r in checked for o in r.outputs]
            logits, hidden = self._pass(checked, None if fed is None else fed.patch)
            drawn = self.sampler.launch(logits, specs) if specs else None
            if drawn is not None and hidden is not None:  # (embeddings: off the decode path, copied now)
                drawn.hidden = hidden.float().cpu()
            return drawn

    def _results(self, checked: list[ForwardRequest], drawn: Drawn | None) -> list[list[OutputResult]]:
        """Per request, its OutputResults from a launched draw; a row that cannot be drawn fails its
        request alone (ForwardError; its K/V writes are idempotent)."""
        try:
            flat = self.sampler.finish(drawn) if drawn is not None else []
        except SampleError as e:
            ends = list(accumulate(len(r.outputs) for r in checked))
            i = bisect.bisect_right(ends, e.row)
            j = e.row - (ends[i] - len(checked[i].outputs))
            raise ForwardError(i, f"forward request {checked[i].name!r}: output {j}: {e.reason}") from None
        out, k = [], 0
        for r in checked:
            out.append(flat[k : k + len(r.outputs)])
            k += len(r.outputs)
        return out

    def _worker(self) -> ThreadPoolExecutor:
        """The thread CPU batches started with `start_forward` run on (made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="pie-backend")
            return self._pool

    def _in_order(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` after every batch started before it: on the worker thread once there is one."""
        pool = self._pool
        if pool is None or threading.current_thread().name.startswith("pie-backend"):
            return fn()
        return pool.submit(fn).result()

    def _check_write_conflicts(self, reqs: list[ForwardRequest]) -> None:
        # Two requests writing the same slot in one pass would race; reject the later one.
        if len(reqs) < 2:
            return
        ps = self.info.page_size
        n_tok = np.fromiter((len(r.tokens) for r in reqs), dtype=np.int64, count=len(reqs))
        ctx = np.fromiter((r.context_len(ps) for r in reqs), dtype=np.int64, count=len(reqs))
        w = write_slots(reqs, ps, ctx, n_tok)
        _, first = np.unique(w, return_index=True)
        if len(first) == len(w):
            return
        later = np.ones(len(w), dtype=bool)
        later[first] = False  # a slot's first writer is fine (one request never writes a slot twice)
        k = int(np.argmax(later))
        i = int(np.searchsorted(np.cumsum(n_tok), k, side="right"))
        p, off = divmod(int(w[k]), ps)
        raise ForwardError(
            i, f"forward request {reqs[i].name!r}: writes slot {off} of page {p}, also written by an "
            "earlier request of the same batch"
        )

    def logits(self, reqs: list[ForwardRequest]) -> list[torch.Tensor]:
        """Float32 logits [len(outputs), vocab] of each request's output rows, from one batched pass.

        For tests and debugging: writes K/V like `forward` but samples nothing.
        """
        checked = [check_request(r, self.info) for r in reqs]

        def run() -> list[torch.Tensor]:
            with self._lock, torch.inference_mode():
                logits, _hidden = self._pass(checked)
            return list(logits.split([len(r.outputs) for r in checked]))

        return self._in_order(run)

    def _pass(self, reqs: list[ForwardRequest], patch: Callable[[BatchPlan], None] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass over validated requests (graph replay when one serves it): logits [outputs, vocab],
        and the output rows' hidden states when a row asks for its own (else None). `patch` changes the
        plan on the device first (`_FedPlan.patch`)."""
        hidden = any(o.hidden for r in reqs for o in r.outputs)
        embeds = self._embeds(reqs)
        if self.graphs is not None and not hidden and embeds is None and self.graphs.accepts(reqs):
            return self.graphs.logits(reqs, patch), None
        plan = self.plan(reqs)
        if patch is not None:
            patch(plan)
        if hidden:
            return self.model.forward_hidden(plan, self.cache, embeds)
        if embeds is None:
            return self.model.forward(plan, self.cache), None
        return self.model.forward(plan, self.cache, embeds), None

    def _embeds(self, reqs: list[ForwardRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The batch rows whose input is an embedding (`ForwardRequest.embeds`) and their vectors."""
        if all(r.embeds is None for r in reqs):
            return None
        hid, rows, vecs, offset = self.info.hidden_size, [], [], 0
        for r in reqs:
            for start, data in r.embeds or ():
                v = np.frombuffer(data, dtype="<f4").reshape(-1, hid)
                rows.append(np.arange(offset + start, offset + start + len(v)))
                vecs.append(v)
            offset += len(r.tokens)
        dev = self.model.device
        return (to_device(np.concatenate(rows).astype(np.int64), dev),
                torch.from_numpy(np.concatenate(vecs)).to(dev))

    def plan(self, reqs: list[ForwardRequest]) -> BatchPlan:
        """The batch plan of validated requests, for this backend's attention and cache."""
        return build_plan(reqs, self.info.page_size, self.model.device, self.model.group, self.attention,
                          num_pages=self.cache.num_pages, window=self.model.window, rope_switch=self.model.rope_switch)

    def input_embeddings(self, tokens: Sequence[int]) -> bytes:
        """The model's input vectors of `tokens` (its embedding table's rows, times its embedding
        scale), float32 little-endian [len(tokens), hidden_size]: what a pass feeds them as."""
        vocab = self.info.vocab_size
        for t in tokens:
            if not isinstance(t, int) or not 0 <= t < vocab:
                raise ValueError(f"token {t!r} outside the vocabulary [0, {vocab})")
        with torch.inference_mode():
            x = self.model.embed[torch.tensor(list(tokens), dtype=torch.long, device=self.model.device)]
            if self.model.embed_scale is not None:
                x = x * self.model.embed_scale
            return x.float().cpu().numpy().astype("<f4").tobytes()

    # -- pages --------------------------------------------------------------------------------

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        """Copy the K/V of `count` tokens from `src_page[src_offset:]` to `dst_page[dst_offset:]`."""
        ps, n = self.info.page_size, self.info.num_pages
        for name, page in (("src_page", src_page), ("dst_page", dst_page)):
            if not isinstance(page, int) or not 0 <= page < n:
                raise ValueError(f"copy_tokens: {name} {page!r} out of range [0, {n})")
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"copy_tokens: count {count!r} must be an int >= 0")
        for name, off in (("src_offset", src_offset), ("dst_offset", dst_offset)):
            if not isinstance(off, int) or off < 0 or off + count > ps:
                raise ValueError(f"copy_tokens: {name} {off!r} + count {count} exceeds page size {ps}")
        if count == 0:
            return
        dev = self.model.device
        src = to_device(np.arange(count) + src_page * ps + src_offset, dev)
        dst = to_device(np.arange(count) + dst_page * ps + dst_offset, dev)

        def run() -> None:
            with self._lock, torch.inference_mode():
                self.cache.copy_slots(src, dst)

        self._in_order(run)

    @property
    def swap_page_bytes(self) -> int:
        """Host memory one swapped page takes (`gpu_backend.types.SwapsPages`)."""
        c = self.cache.data
        return c.shape[0] * self.cache.page_size * c[0, 0].numel() * c.element_size()

    def swap_out(self, pages: Sequence[int]) -> torch.Tensor:
        """`pages`' K/V copied to host memory (`gpu_backend.types.SwapsPages`), after the batches started before."""

        def run() -> torch.Tensor:
            with self._lock, torch.inference_mode():
                return self.cache.read_pages(list(pages))

        return self._in_order(run)

    def swap_in(self, swapped: object, pages: Sequence[int]) -> None:
        """Write a `swap_out` copy back into `pages` (`gpu_backend.types.SwapsPages`)."""
        assert isinstance(swapped, torch.Tensor)

        def run() -> None:
            with self._lock, torch.inference_mode():
                self.cache.write_pages(list(pages), swapped)

        self._in_order(run)

    # -- plain generation loop (baseline and demo): gpu_backend/generate.py --------------------

    def generate(self, prompt_ids: list[int], max_tokens: int, sampler: SamplerParams = GREEDY,
                 stop_tokens: list[int] | None = None, pages: list[int] | None = None) -> list[int]:
        """Generate up to `max_tokens` tokens after `prompt_ids`; see `generate_batch`."""
        return self.generate_batch([prompt_ids], max_tokens, sampler, stop_tokens,
                                   None if pages is None else [pages])[0]

    def generate_batch(self, prompts: list[list[int]], max_tokens: int, sampler: SamplerParams = GREEDY,
                       stop_tokens: list[int] | None = None, pages: list[list[int]] | None = None) -> list[list[int]]:
        """Prefill all prompts in one pass, then decode them in lock step (gpu_backend/generate.py)."""
        return generate_batch(self, prompts, max_tokens, sampler, stop_tokens, pages)
