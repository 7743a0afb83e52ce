"""WIT interface `forward`: submit forward passes, wait on one or any, the one-token decode step, and
the host-side generation loop (`generate`, 0.2.0). The checks and bookkeeping they share are in
host/api/passes.py, the decode-step lookahead in host/api/lookahead.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from wasmtime.component import Record

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, Tokenizer
from host.api.guest import GuestError, Import, guest_import
from host.api.kv import allocate
from host.api.lookahead import Stepper
from host.api.passes import Passes, generation, generation_record, outputs_of
from host.batching.generation import Generation, GenerationResult
from host.replicas import Replica
from host.wasm.instance import Instance


def imports(replicas: Sequence[Replica], info: BackendInfo, tok: Tokenizer,
            lookahead: bool = True) -> dict[str, Import]:
    """The `forward` imports; `lookahead`: run a stepping guest's predicted next step ahead (host/api/lookahead.py)."""
    passes = Passes(replicas, info, lookahead)

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

    @guest_import("forward.run-scored")
    def run_scored(inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
                   mask: list[list[int]], outputs: list[Any], targets: list[int]) \
            -> tuple[list[OutputResult], list[float]]:
        if len(targets) != len(outputs):
            raise GuestError(f"run-scored: {len(targets)} targets for {len(outputs)} outputs")
        specs = [dataclasses.replace(o, target=t) for o, t in zip(outputs_of(outputs), targets, strict=True)]
        req = passes.admit(inst, ForwardRequest(pages=pages, last_page_len=last_len, tokens=tokens,
                                                positions=positions, mask=mask or None, outputs=specs,
                                                name=inst.label))
        result = passes.take(inst, inst.new_handle(passes.scheduler(inst).submit(req, inst.id)))
        return result, [float(r.logprob if r.logprob is not None else 0.0) for r in result]

    @guest_import("forward.decode-step", keeps_lookahead=True)  # it claims the prediction
    def decode_step(inst: Instance, pages: list[int], last_len: int, token: int, position: int,
                    sampler: Any) -> int:
        stepper = inst.stepper
        if not isinstance(stepper, Stepper):
            stepper = inst.stepper = Stepper(passes, inst)
        out: int = stepper.step(pages, last_len, token, position, sampler)
        return out

    def run_generation(inst: Instance, make: Callable[[], Generation], first_pages: list[int]) -> Record:
        with passes.gate(inst):
            gen = make()
            fut = passes.scheduler(inst).submit(gen.request, inst.id, generation=gen)
            inst.pages.loop = gen  # (ended with out-of-pages if the instance is suspended: host/suspend.py)
        try:
            result: GenerationResult = inst.wait_for(fut, gen.cancel)
        finally:
            inst.pages.loop = None
        if first_pages and not result.tokens:  # (ended before its first token: the caller holds nothing new)
            with passes.gate(inst):
                passes.pm(inst).release(inst.pages, first_pages + result.new_pages)
            result = dataclasses.replace(result, new_pages=[])
        elif first_pages:
            result = dataclasses.replace(result, new_pages=first_pages + result.new_pages)
        return generation_record(result)

    @guest_import("forward.generate")
    def generate(inst: Instance, *args: Any) -> Record:
        return run_generation(inst, lambda: generation(passes, tok, inst, *args), [])

    @guest_import("forward.generate-fresh")
    def generate_fresh(inst: Instance, tokens: list[int], sampler: Any, max_tokens: int, stop_tokens: list[int],
                       stop_strings: list[str], stream: bool, prefix_cache: bool) -> Record:
        first = _fresh_pages(passes, inst, tokens, prefix_cache)
        if first is None:
            return generation_record(GenerationResult([], [], 0, "out-of-pages"))
        pages, cached = first

        def make() -> Generation:
            try:
                return generation(passes, tok, inst, pages, len(tokens) - (len(pages) - 1) * passes.page_size,
                                  tokens[cached:], list(range(cached, len(tokens))), sampler, max_tokens,
                                  stop_tokens, stop_strings, stream)
            except BaseException:
                passes.pm(inst).release(inst.pages, pages)  # a bad argument: the caller traps holding nothing new
                raise

        return run_generation(inst, make, pages)

    return {"submit": submit, "wait": wait, "wait-any": wait_any, "run": run, "run-scored": run_scored,
            "decode-step": decode_step, "generate": generate, "generate-fresh": generate_fresh}


def _fresh_pages(passes: Passes, inst: Instance, tokens: list[int], prefix_cache: bool) \
        -> tuple[list[int], int] | None:
    """`forward.generate-fresh`'s pages for `tokens` at positions 0..: the prefix cache's pages for
    the longest full-page prefix of all but the last token, then fresh ones from the instance's
    quota; with how many tokens the cached pages hold. None (nothing held) if the quota or the
    pool refuses."""
    inst.check_alive()
    if not tokens:
        raise GuestError("no pending tokens to start from")
    ps, pm = passes.page_size, passes.pm(inst)
    with passes.gate(inst):
        cached = pm.attach_prefix(inst.pages, tokens[:-1]) if prefix_cache and len(tokens) > ps else []
    fresh = allocate(passes.replicas[inst.pages.replica], inst, -(-len(tokens) // ps) - len(cached))
    if isinstance(fresh, str):
        if cached:
            with passes.gate(inst):
                pm.release(inst.pages, cached)
        return None
    return cached + fresh, len(cached) * ps
