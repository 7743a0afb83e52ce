"""WIT interface `forward`: submit forward passes, wait on one or any, the one-token decode step, and
the host-side generation loop (`generate`, 0.2.0).

Each pass is checked here, once, where it enters the host: the page list against what the
instance holds, the rest by `gpu_backend.validate.check_request` (the backend trusts a checked
request). `decode-step` checks its fixed shape inline instead: it is the call made per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from wasmtime.component import Record

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, OutputSpec, SamplerParams, Tokenizer
from gpu_backend.validate import as_sampler, check_request
from host.api.guest import GuestError, Import, guest_import
from host.batching.generation import Generation, GenerationResult, StopRules
from host.batching.scheduler import Scheduler
from host.state.pages import PageManager
from host.wasm.instance import Instance


def _sampler(rec: Any) -> SamplerParams:
    return SamplerParams(temperature=rec.temperature, top_k=getattr(rec, "top-k"), top_p=getattr(rec, "top-p"),
                         min_p=getattr(rec, "min-p"), seed=rec.seed)


def _outputs(specs: list[Any]) -> list[OutputSpec]:
    return [OutputSpec(index=s.index, sample=None if s.sample is None else _sampler(s.sample), dist=s.dist)
            for s in specs]


class _Passes:
    """The checks and bookkeeping the forward imports share."""

    def __init__(self, pm: PageManager, scheduler: Scheduler, info: BackendInfo) -> None:
        self.pm, self.scheduler, self.info = pm, scheduler, info
        self.page_size = info.page_size
        self.max_position = info.max_position or 2**32
        self.decode_specs: dict[tuple[Any, ...], list[OutputSpec]] = {}  # sampler fields -> [OutputSpec]

    def check_pages(self, inst: Instance, pages: list[int], last_len: int, n_tokens: int, step: bool = False) -> int:
        """The page list of a pass of `n_tokens` new tokens: held by the instance, long enough, written
        pages writable (`step`: and none repeated, checked incrementally from the last step's list).
        Returns the pass's context length (tokens in the pages before it)."""
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
        if step:
            self.pm.check_step_pages(inst.pages, pages, writable_from=ctx // ps)
        else:
            self.pm.check_pages(inst.pages, pages, writable_from=ctx // ps)
        return ctx

    def submit(self, inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
               mask: list[list[int]], outputs: list[Any]) -> int:
        req = ForwardRequest(pages=pages, last_page_len=last_len, tokens=tokens, positions=positions,
                             mask=mask or None, outputs=_outputs(outputs), name=inst.label)
        ctx = self.check_pages(inst, pages, last_len, len(tokens))
        req = check_request(req, self.info)
        self.pm.note_write(inst.pages, req, self.page_size, context_len=ctx)
        return inst.new_handle(self.scheduler.submit(req, inst.id))

    def take(self, inst: Instance, handle: int) -> list[OutputResult]:
        fut = inst.forwards.get(handle)
        if fut is None:
            raise GuestError(f"unknown forward handle {handle} (never submitted or already waited on)")
        inst.wait_until(fut.done)
        del inst.forwards[handle]
        result: list[OutputResult] = fut.wait()
        return result

    def decode_request(self, inst: Instance, pages: list[int], last_len: int, token: int, position: int,
                       sampler: Any) -> ForwardRequest:
        """forward.run(pages, last_len, [token], [position], [], [sample-only spec at 0]), checked
        inline: everything check_request would reject, for this fixed shape (the call made per token)."""
        ctx = self.check_pages(inst, pages, last_len, 1, step=True)  # no page repeated either
        if token >= self.info.vocab_size:
            raise GuestError(f"token {token} is outside the vocabulary (size {self.info.vocab_size})")
        if position >= self.max_position:
            raise GuestError(f"position {position} is past the model's maximum {self.max_position - 1}")
        key = tuple(sampler.__dict__.values())
        outputs = self.decode_specs.get(key)
        if outputs is None:
            outputs = [OutputSpec(index=0, sample=as_sampler(_sampler(sampler), "sampler"))]
            if len(self.decode_specs) < 1024:
                self.decode_specs[key] = outputs
        req = ForwardRequest(pages=pages, last_page_len=last_len, tokens=[token], positions=[position],
                             outputs=outputs, name=inst.label, checked=True)
        self.pm.note_write(inst.pages, req, self.page_size, context_len=ctx)
        return req


def _generation(passes: _Passes, tok: Tokenizer, inst: Instance, pages: list[int], last_len: int,
                tokens: list[int], positions: list[int], sampler: Any, max_tokens: int, stop_tokens: list[int],
                stop_strings: list[str], stream: bool, make: Callable[..., Generation] = Generation) -> Generation:
    """The checked first step and the loop state of `forward.generate` (a `make` loop, e.g. constrained)."""
    if max_tokens < 1:
        raise GuestError(f"max-tokens must be >= 1, got {max_tokens}")
    if any(not s for s in stop_strings):
        raise GuestError("a stop string is empty")
    if not tokens:
        raise GuestError("no pending tokens to start from")
    sample = as_sampler(_sampler(sampler), "sampler")
    req = ForwardRequest(pages=list(pages), last_page_len=last_len, tokens=tokens, positions=positions,
                         outputs=[OutputSpec(index=len(tokens) - 1, sample=sample)], name=inst.label)
    ctx = passes.check_pages(inst, req.pages, last_len, len(tokens))
    req = check_request(req, passes.info)
    passes.pm.note_write(inst.pages, req, passes.page_size, context_len=ctx)
    rules = StopRules(max_tokens, frozenset(stop_tokens), tuple(stop_strings), passes.max_position)
    send = (lambda text: inst.emit("message", text)) if stream else None
    return make(req, sample, rules, passes.page_size, passes.pm, inst.pages, tok.decode, send)


def _generation_record(res: GenerationResult) -> Record:
    rec = Record()
    rec.__dict__.update({"tokens": res.tokens, "new-pages": res.new_pages, "trim": res.trim, "finish": res.finish})
    return rec


def imports(pm: PageManager, scheduler: Scheduler, info: BackendInfo, tok: Tokenizer) -> dict[str, Import]:
    passes = _Passes(pm, scheduler, info)

    @guest_import("forward.submit")
    def submit(inst: Instance, *args: Any) -> int:
        return passes.submit(inst, *args)

    @guest_import("forward.wait")
    def wait(inst: Instance, handle: int) -> list[OutputResult]:
        return passes.take(inst, handle)

    @guest_import("forward.wait-any")
    def wait_any(inst: Instance, handles: list[int]) -> tuple[int, list[OutputResult]]:
        if not handles:
            raise GuestError("wait-any on an empty handle list")
        for h in handles:
            if h not in inst.forwards:
                raise GuestError(f"unknown forward handle {h} (never submitted or already waited on)")
        found: list[int] = []

        def any_done() -> bool:
            found[:] = [h for h in handles if inst.forwards[h].done()][:1]
            return bool(found)

        inst.wait_until(any_done)
        return found[0], passes.take(inst, found[0])

    @guest_import("forward.run")
    def run(inst: Instance, *args: Any) -> list[OutputResult]:
        return passes.take(inst, passes.submit(inst, *args))

    @guest_import("forward.decode-step")
    def decode_step(inst: Instance, pages: list[int], last_len: int, token: int, position: int,
                    sampler: Any) -> int:
        req = passes.decode_request(inst, pages, last_len, token, position, sampler)
        fut = scheduler.submit(req, inst.id)
        fut.add_done_callback(inst.wake)
        inst.wait_until(fut.done)
        out: int | None = fut.wait()[0].token
        assert out is not None  # the spec asked for a sampled token
        return out

    @guest_import("forward.generate")
    def generate(inst: Instance, *args: Any) -> Record:
        gen = _generation(passes, tok, inst, *args)
        fut = scheduler.submit(gen.request, inst.id, generation=gen)
        fut.add_done_callback(inst.wake)
        try:
            inst.wait_until(fut.done)
        except BaseException:
            gen.cancelled = True  # terminated or out of budget: the loop ends at its next step
            raise
        result: GenerationResult = fut.wait()
        return _generation_record(result)

    return {"submit": submit, "wait": wait, "wait-any": wait_any, "run": run, "decode-step": decode_step,
            "generate": generate}
