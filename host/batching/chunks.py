"""Chunked prefill: a long forward split into consecutive passes across batches.

A KV-cache write is per token slot, so the new tokens of a forward can run as consecutive
chunks, each writing its tokens' K/V and attending to everything before it (the context and the
chunks already run). Each chunk is a `ForwardRequest` of its own: the page list up to its last
token, that page's length, its tokens, positions and mask rows (a BRLE row covers the context
plus the tokens up to its own, so the rows are the same rows), and the outputs whose index falls
inside it, remapped. An output is produced by the chunk holding its index; the job's result
puts them back in the order asked. Only the last chunk completes the job (host/batching/queue.py
takes the chunks, host/batching/scheduler.py runs them).
"""

from __future__ import annotations

from dataclasses import replace

from gpu_backend.types import ForwardRequest, OutputResult

__all__ = ["Chunks", "chunk_request"]


def chunk_request(req: ForwardRequest, start: int, n: int, page_size: int) -> tuple[ForwardRequest, list[int]]:
    """The pass over `req.tokens[start:start + n]`, with the chunks before it already run, and the
    indices into `req.outputs` of the outputs it produces (in that order)."""
    end = len(req.tokens) if start + n >= len(req.tokens) else start + n
    total = req.context_len(page_size) + end
    npages = -(-total // page_size)
    which = [k for k, o in enumerate(req.outputs) if start <= o.index < end]
    outputs = [replace(req.outputs[k], index=req.outputs[k].index - start) for k in which]
    part = ForwardRequest(pages=req.pages[:npages], last_page_len=total - (npages - 1) * page_size,
                          tokens=req.tokens[start:end], positions=req.positions[start:end],
                          mask=None if req.mask is None else req.mask[start:end], outputs=outputs, name=req.name)
    part.checked = req.checked  # a part of a checked request is valid by construction
    return part, which


class Chunks:
    """A forward's progress through its chunks (`ForwardFuture.chunks`): `done` new tokens have run,
    `results` holds the outputs produced so far (by position in the request's outputs); `part` is
    the chunk in the batch being run and `which` its outputs' positions; `running` while a chunk
    that is not the last is in a batch (the job stays queued meanwhile, in its place)."""

    __slots__ = ("done", "results", "part", "which", "running")

    def __init__(self, outputs: int) -> None:
        self.done = 0
        self.results: list[OutputResult | None] = [None] * outputs
        self.part: ForwardRequest | None = None
        self.which: list[int] = []
        self.running = False

    def take(self, req: ForwardRequest, n: int, page_size: int) -> ForwardRequest:
        """Make the next chunk, of `n` tokens (fewer if fewer are left), the one in flight."""
        self.part, self.which = chunk_request(req, self.done, n, page_size)
        return self.part

    def ran(self, outputs: list[OutputResult]) -> list[OutputResult]:
        """The chunk in flight has run with `outputs`; returns every output produced so far, in
        the request's order (the job's result once the last chunk has run)."""
        assert self.part is not None
        for k, r in zip(self.which, outputs, strict=True):
            self.results[k] = r
        self.done += len(self.part.tokens)
        self.part, self.which, self.running = None, [], False
        return [r if r is not None else OutputResult() for r in self.results]
