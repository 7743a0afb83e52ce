"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode batch (every request adds one token, no BRLE rows) of B requests runs in the graph of the
smallest bucket >= B: the batch is padded with dummy requests that write and read only a scratch
page the caller never owns, its plan is built as usual, and its tensors are copied into the static
buffers the graph was captured on; logits come out for every row of the bucket and the real output
rows are picked (and sampled, eagerly) right after the replay. With SDPA the gathered KV axis is
part of the shapes, so its graphs are keyed by (batch bucket, power-of-two KV length); with
FlexAttention the metadata's shapes depend on the batch bucket alone. Anything else (prefill, mixed
or masked batches, more requests than the largest bucket) runs eagerly.

The padding, static buffers and refill logic run on CPU in the tests (`capture=False` replays by
calling the forward on the static buffers); capture and replay ran on one H100 (bench/gpu_suite.py:
graphs on == off token for token with SDPA and flex; 1B shape, batch 1: 103 -> 526 tokens/s).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from gpu_backend.attention import Attention, BatchPlan, build_plan, to_device
from gpu_backend.kv_cache import KVCache
from gpu_backend.models.llama import LlamaModel
from gpu_backend.types import ForwardRequest

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def bucket_for(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= n (buckets sorted ascending), or None when n is past the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def pad_batch(reqs: list[ForwardRequest], bucket: int, scratch_page: int) -> list[ForwardRequest]:
    """`reqs` followed by one-token dummies up to `bucket` requests.

    A dummy has no outputs and only the scratch page: it writes slot 0 of it and attends to that
    slot alone. Dummies all write the same slot; what lands there is never read by a real request.
    """
    dummy = ForwardRequest(pages=[scratch_page], last_page_len=1, tokens=[0], positions=[0], outputs=[],
                           name="cuda-graph padding", checked=True)
    return list(reqs) + [dummy] * (bucket - len(reqs))


def plan_tensors(plan: BatchPlan) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a forward pass reads from `plan` (its own and its attention metadata's, nested
    dataclasses included: flex's per-window block masks), by name."""
    out: list[tuple[str, torch.Tensor]] = []

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if isinstance(value, torch.Tensor):
                out.append((prefix + f.name, value))
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                walk(value, f"{prefix}{f.name}.")

    walk(plan, "")
    walk(plan.meta, "meta.")
    return out


def refill(static: BatchPlan, new: BatchPlan) -> None:
    """Copy `new`'s tensors into `static`'s (same layout): the captured graph then computes `new`."""
    a, b = plan_tensors(static), plan_tensors(new)
    if [n for n, _ in a] != [n for n, _ in b]:
        raise RuntimeError(f"cuda graph: plan fields differ: {[n for n, _ in a]} vs {[n for n, _ in b]}")
    for (name, dst), (_, src) in zip(a, b, strict=True):
        if dst.shape != src.shape:
            raise RuntimeError(f"cuda graph: {name} has shape {tuple(src.shape)}, captured {tuple(dst.shape)}")
        dst.copy_(src)


@dataclass
class _Graph:
    plan: BatchPlan  # the static buffers the graph reads
    logits: torch.Tensor | None  # [bucket, vocab] the graph writes (None when not captured)
    graph: torch.cuda.CUDAGraph | None


class DecodeGraphs:
    """Captured decode graphs of one model and cache, built lazily per bucket on first use.

    `scratch_page`: a physical page of `cache` outside the caller's range (padding rows use it).
    `capture=False` skips the capture and runs the forward on the static buffers instead: the same
    padding and refill path, for checking it on CPU. `compile_layers`: the forward runs the layers'
    parts around attention through torch.compile (`LlamaModel.hidden(compiled=True)`): compiled in
    the first warm-up pass of each bucket (one compile per batch bucket; the KV length is not part
    of the compiled shapes), never during the capture.
    """

    def __init__(self, model: LlamaModel, cache: KVCache, attention: Attention, page_size: int,
                 scratch_page: int, buckets: Sequence[int] = DEFAULT_BUCKETS, capture: bool = True,
                 compile_layers: bool = False) -> None:
        if not 0 <= scratch_page < cache.num_pages:
            raise ValueError(f"scratch page {scratch_page} is not a page of the cache ({cache.num_pages} pages)")
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.cache, self.attention = model, cache, attention
        self.page_size, self.scratch_page = page_size, scratch_page
        self.buckets = sorted(buckets)
        self.capture = capture
        if compile_layers and model.reduce is not None:
            raise ValueError("compile_layers: compiled layers run on a single rank (not with tensor parallel)")
        self.compile_layers = compile_layers
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool: Any = None  # one memory pool shared by all graphs (torch.cuda._POOL_HANDLE)

    def accepts(self, reqs: list[ForwardRequest]) -> bool:
        """True for a decode batch a graph serves: one token per request, no BRLE rows, not too many."""
        return (bucket_for(len(reqs), self.buckets) is not None
                and all(len(r.tokens) == 1 and r.mask is None for r in reqs))

    def captured(self) -> list[tuple[int, int]]:
        """Keys (batch bucket, KV slots; 0 = any) of the graphs captured so far."""
        return sorted(self._graphs)

    def logits(self, reqs: list[ForwardRequest], patch: Callable[[BatchPlan], None] | None = None) -> torch.Tensor:
        """Float32 logits [outputs, vocab] of the requests' output rows, in order (an accepted batch).
        `patch` may change the batch's plan (on the device) before the graph's buffers are refilled."""
        bucket = bucket_for(len(reqs), self.buckets)
        if bucket is None:
            raise ValueError(f"cuda graph: {len(reqs)} requests, the largest bucket is {self.buckets[-1]}")
        max_len = max(r.total_len(self.page_size) for r in reqs)
        key = (bucket, self.attention.graph_slots(max_len))
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(*key)
        plan = self._plan(pad_batch(reqs, bucket, self.scratch_page), key[1])
        if patch is not None:
            patch(plan)
        refill(g.plan, plan)
        if g.graph is None:
            out = self.model.forward(g.plan, self.cache, compiled=self.compile_layers)
        else:
            g.graph.replay()
            assert g.logits is not None  # captured together with the graph
            out = g.logits
        # one token per request: request i's outputs are all row i
        rows = [i for i, r in enumerate(reqs) for _ in r.outputs]
        return out[to_device(np.asarray(rows, dtype=np.int64), out.device)]

    def _plan(self, reqs: list[ForwardRequest], kv_slots: int) -> BatchPlan:
        return build_plan(reqs, self.page_size, self.model.device, self.model.group, self.attention,
                          num_pages=self.cache.num_pages, kv_slots=kv_slots, static=True, all_rows=True,
                          window=self.model.window, rope_switch=self.model.rope_switch)

    def _capture(self, bucket: int, kv_slots: int) -> _Graph:
        plan = self._plan(pad_batch([], bucket, self.scratch_page), kv_slots)
        if not self.capture:
            return _Graph(plan, None, None)
        dev = self.model.device
        # warm up on a side stream (compiles flex_attention and, with compile_layers, the layers for
        # this shape, settles lazy inits) so nothing is compiled or allocated outside the pool during
        # capture; dummies only touch the scratch page
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                self.model.forward(plan, self.cache, compiled=self.compile_layers)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model.forward(plan, self.cache, compiled=self.compile_layers)
        if self._pool is None:
            self._pool = graph.pool()
        return _Graph(plan, logits, graph)
