"""How a guest's forward pass enters the host: the checks (`Passes.admit`), submit and wait, the
per-token decode step checked inline, and a host-side loop's first step (`generation`).

Each pass is checked here, once, where it enters the host: the page list against what the
instance holds, the rest by `gpu_backend.validate.check_request` (the backend trusts a checked
request). `decode-step` checks its fixed shape inline instead (`Passes.decode_request`): it is the
call made per token. Shared by the `forward` imports (host/api/forward.py), the constrained ones
(host/api/constrained.py) and the decode-step lookahead (host/api/lookahead.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from wasmtime.component import Record

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, OutputSpec, SamplerParams, Tokenizer
from gpu_backend.validate import as_sampler, check_request
from host.api.guest import GuestError
from host.batching.generation import Generation, GenerationResult, StopRules
from host.batching.scheduler import Scheduler
from host.replicas import Replica
from host.state.pages import PageManager
from host.wasm.instance import Instance

__all__ = ["Passes", "generation", "generation_record", "outputs_of", "sampler_of"]


def sampler_of(rec: Any) -> SamplerParams:
    return SamplerParams(temperature=rec.temperature, top_k=getattr(rec, "top-k"), top_p=getattr(rec, "top-p"),
                         min_p=getattr(rec, "min-p"), seed=rec.seed)


def outputs_of(specs: list[Any]) -> list[OutputSpec]:
    return [OutputSpec(index=s.index, sample=None if s.sample is None else sampler_of(s.sample), dist=s.dist)
            for s in specs]


class Passes:
    """The checks and bookkeeping the forward imports share (one per host and replica set)."""

    def __init__(self, replicas: Sequence[Replica], info: BackendInfo, lookahead: bool = True) -> None:
        self.replicas, self.info = replicas, info
        self.lookahead = lookahead  # run a stepping guest's predicted next decode-step ahead (host/api/lookahead.py)
        self.page_size = info.page_size
        self.max_position = info.max_position or 2**32
        self.decode_specs: dict[tuple[Any, ...], list[OutputSpec]] = {}  # sampler fields -> [OutputSpec]

    def pm(self, inst: Instance) -> PageManager:
        """The page manager of the instance's replica."""
        return self.replicas[inst.pages.replica].pages

    def scheduler(self, inst: Instance) -> Scheduler:
        """The scheduler of the instance's replica."""
        return self.replicas[inst.pages.replica].scheduler

    def gate(self, inst: Instance) -> AbstractContextManager[Any]:
        """What a call that checks pages and queues work on them runs in (host/suspend.py)."""
        return self.replicas[inst.pages.replica].gate(inst)

    def gate_now(self, inst: Instance) -> AbstractContextManager[Any] | None:
        """`gate(inst)` entered without waiting (leave it with `__exit__`), or None if that would wait."""
        return self.replicas[inst.pages.replica].gate_now(inst)

    def check_pages(self, inst: Instance, pages: list[int], last_len: int, n_tokens: int,
                    step: bool = False) -> tuple[int, list[int]]:
        """The page list of a pass of `n_tokens` new tokens: held by the instance, long enough, written
        pages writable (`step`: and none repeated, checked incrementally from the last step's list).
        Returns the pass's context length (tokens in the pages before it) and its physical pages
        (the list itself unless the instance was resumed into other pages: host/state/pages.py)."""
        inst.check_alive()
        ps = self.page_size
        if not pages:
            raise GuestError("empty page list")
        if not 1 <= last_len <= ps:
            raise GuestError(f"last-page-len {last_len} is outside 1..{ps}")
        total = (len(pages) - 1) * ps + last_len
        if n_tokens > total:
            raise GuestError(f"{n_tokens} new tokens do not fit: the {len(pages)} pages with "
                             f"last-page-len {last_len} hold {total} tokens")
        ctx = total - n_tokens
        pm = self.pm(inst)
        if step:
            return ctx, pm.check_step_pages(inst.pages, pages, writable_from=ctx // ps)
        pm.check_pages(inst.pages, pages, writable_from=ctx // ps)
        return ctx, pm.to_phys(inst.pages, pages)

    def admit(self, inst: Instance, req: ForwardRequest) -> ForwardRequest:
        """The boundary check of a pass a guest asked for: its pages (`check_pages`), then everything
        else (`check_request`: the request comes back checked), then its writes noted for the prefix
        cache. Every forward import admits its request here (decode steps: `decode_request`)."""
        ctx, req.pages = self.check_pages(inst, req.pages, req.last_page_len, len(req.tokens))
        req = check_request(req, self.info)
        self.pm(inst).note_write(inst.pages, req, self.page_size, context_len=ctx)
        return req

    def submit(self, inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
               mask: list[list[int]], outputs: list[Any]) -> int:
        with self.gate(inst):
            req = self.admit(inst, ForwardRequest(pages=pages, last_page_len=last_len, tokens=tokens,
                                                  positions=positions, mask=mask or None, outputs=outputs_of(outputs),
                                                  name=inst.label))
            return inst.new_handle(self.scheduler(inst).submit(req, inst.id))

    def take(self, inst: Instance, handle: int) -> list[OutputResult]:
        fut = inst.forwards.get(handle)
        if fut is None:
            raise GuestError(f"unknown forward handle {handle} (never submitted or already waited on)")
        inst.wait_until(fut.done)
        del inst.forwards[handle]
        result: list[OutputResult] = fut.wait()
        return result

    def decode_request(self, inst: Instance, pages: list[int], last_len: int, token: int, position: int,
                       sampler: Any, key: tuple[Any, ...]) -> ForwardRequest:
        """forward.run(pages, last_len, [token], [position], [], [sample-only spec at 0]), checked
        inline: everything check_request would reject, for this fixed shape (the call made per token).
        `key`: the sampler's fields, as a tuple. Run it and the submit in `gate`."""
        ctx, phys = self.check_pages(inst, pages, last_len, 1, step=True)  # no page repeated either
        if token >= self.info.vocab_size:
            raise GuestError(f"token {token} is outside the vocabulary (size {self.info.vocab_size})")
        if position >= self.max_position:
            raise GuestError(f"position {position} is past the model's maximum {self.max_position - 1}")
        outputs = self.decode_specs.get(key)
        if outputs is None:
            outputs = [OutputSpec(index=0, sample=as_sampler(sampler_of(sampler), "sampler"))]
            if len(self.decode_specs) < 1024:
                self.decode_specs[key] = outputs
        req = ForwardRequest(pages=phys, last_page_len=last_len, tokens=[token], positions=[position],
                             outputs=outputs, name=inst.label, checked=True)
        self.pm(inst).note_write(inst.pages, req, self.page_size, context_len=ctx)
        return req


def generation(passes: Passes, tok: Tokenizer, inst: Instance, pages: list[int], last_len: int,
                tokens: list[int], positions: list[int], sampler: Any, max_tokens: int, stop_tokens: list[int],
                stop_strings: list[str], stream: bool, make: Callable[..., Generation] = Generation) -> Generation:
    """The checked first step and the loop state of `forward.generate` (a `make` loop, e.g. constrained).
    Run it and the submit in `Passes.gate`."""
    if max_tokens < 1:
        raise GuestError(f"max-tokens must be >= 1, got {max_tokens}")
    if any(not s for s in stop_strings):
        raise GuestError("a stop string is empty")
    if not tokens:
        raise GuestError("no pending tokens to start from")
    sample = as_sampler(sampler_of(sampler), "sampler")
    req = passes.admit(inst, ForwardRequest(pages=list(pages), last_page_len=last_len, tokens=tokens,
                                            positions=positions, name=inst.label,
                                            outputs=[OutputSpec(index=len(tokens) - 1, sample=sample)]))
    rules = StopRules(max_tokens, frozenset(stop_tokens), tuple(stop_strings), passes.max_position)
    send = (lambda text: inst.emit("message", text)) if stream else None
    return make(req, sample, rules, passes.page_size, passes.pm(inst), inst.pages, tok.decode, send)


def generation_record(res: GenerationResult) -> Record:
    rec = Record()
    rec.__dict__.update({"tokens": res.tokens, "new-pages": res.new_pages, "trim": res.trim, "finish": res.finish})
    return rec
