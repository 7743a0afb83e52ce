"""WIT interface `forward`: submit forward passes, wait on one or any, the one-token decode step, and
the host-side generation loop (`generate`, 0.2.0). The checks and bookkeeping they share are in
host/api/passes.py, the decode-step lookahead in host/api/lookahead.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from wasmtime.component import Record

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, Tokenizer
from host.api.guest import WOULD_WAIT, Begun, GuestError, Import, guest_import
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
            if inst.pages.loop is gen:
                inst.pages.loop = None
        record = finish_generation(inst, result, first_pages, True)
        assert isinstance(record, Record)
        return record

    def begin_generation(inst: Instance, make: Callable[[], Generation], first_pages: list[int],
                         gate: AbstractContextManager[Any]) -> Begun:
        """`run_generation` begun without waiting, in `gate` (entered by the caller, left here)."""
        try:
            gen = make()
            fut = passes.scheduler(inst).submit(gen.request, inst.id, generation=gen)
            inst.pages.loop = gen
        finally:
            gate.__exit__(None, None, None)

        def abort() -> None:  # (terminated: the loop ends at its next step; its pages stay held until the end)
            gen.cancel()
            if inst.pages.loop is gen:
                inst.pages.loop = None

        def finish(wait: bool) -> Record | object:
            if inst.pages.loop is gen:  # (before its result, which raises if the loop failed)
                inst.pages.loop = None
            return finish_generation(inst, fut.wait(), first_pages, wait)

        return Begun(fut, finish, abort)

    def finish_generation(inst: Instance, result: GenerationResult, first_pages: list[int],
                          wait: bool) -> Record | object:
        """The record of an ended generation; a fresh one (`first_pages`) that ended before its first
        token gives its pages back, so the caller holds nothing new (`WOULD_WAIT` where that would
        wait and `wait` is False)."""
        if first_pages and not result.tokens:
            pages = first_pages + result.new_pages
            if wait:
                with passes.gate(inst):
                    passes.pm(inst).release(inst.pages, pages)
            else:
                gate = passes.gate_now(inst)
                if gate is None:
                    return WOULD_WAIT
                try:
                    passes.pm(inst).release(inst.pages, pages)
                finally:
                    gate.__exit__(None, None, None)
            result = dataclasses.replace(result, new_pages=[])
        elif first_pages:
            result = dataclasses.replace(result, new_pages=first_pages + result.new_pages)
        return generation_record(result)

    def generate_now(inst: Instance, *args: Any) -> Begun | None:
        inst.check_alive()
        gate = passes.gate_now(inst)
        return None if gate is None else begin_generation(inst, lambda: generation(passes, tok, inst, *args), [], gate)

    @guest_import("forward.generate", begin=generate_now)
    def generate(inst: Instance, *args: Any) -> Record:
        return run_generation(inst, lambda: generation(passes, tok, inst, *args), [])

    def fresh(inst: Instance, pages: list[int], cached: int, tokens: list[int], sampler: Any, max_tokens: int,
              stop_tokens: list[int], stop_strings: list[str], stream: bool) -> Callable[[], Generation]:
        """How `generate-fresh` makes its generation on the pages it took (`cached` tokens from the cache)."""
        def make() -> Generation:
            try:
                return generation(passes, tok, inst, pages, len(tokens) - (len(pages) - 1) * passes.page_size,
                                  tokens[cached:], list(range(cached, len(tokens))), sampler, max_tokens,
                                  stop_tokens, stop_strings, stream)
            except BaseException:
                passes.pm(inst).release(inst.pages, pages)  # a bad argument: the caller traps holding nothing new
                raise

        return make

    def generate_fresh_now(inst: Instance, tokens: list[int], sampler: Any, max_tokens: int,
                           stop_tokens: list[int], stop_strings: list[str], stream: bool,
                           prefix_cache: bool) -> Begun | None:
        inst.check_alive()
        if not tokens:
            raise GuestError("no pending tokens to start from")
        gate = passes.gate_now(inst)
        if gate is None:
            return None
        try:
            first = _fresh_pages_now(passes, inst, tokens, prefix_cache)
        except BaseException:
            gate.__exit__(None, None, None)
            raise
        if first is None or isinstance(first, str):
            gate.__exit__(None, None, None)
            return None if first is None else Begun.now(generation_record(GenerationResult([], [], 0, "out-of-pages")))
        pages, cached = first
        return begin_generation(inst, fresh(inst, pages, cached, tokens, sampler, max_tokens, stop_tokens,
                                            stop_strings, stream), pages, gate)

    @guest_import("forward.generate-fresh", begin=generate_fresh_now)
    def generate_fresh(inst: Instance, tokens: list[int], sampler: Any, max_tokens: int, stop_tokens: list[int],
                       stop_strings: list[str], stream: bool, prefix_cache: bool) -> Record:
        first = _fresh_pages(passes, inst, tokens, prefix_cache)
        if first is None:
            return generation_record(GenerationResult([], [], 0, "out-of-pages"))
        pages, cached = first
        return run_generation(inst, fresh(inst, pages, cached, tokens, sampler, max_tokens, stop_tokens,
                                          stop_strings, stream), pages)

    return {"submit": submit, "wait": wait, "wait-any": wait_any, "run": run, "run-scored": run_scored,
            "decode-step": decode_step, "generate": generate, "generate-fresh": generate_fresh}


def _fresh_pages_now(passes: Passes, inst: Instance, tokens: list[int], prefix_cache: bool) \
        -> tuple[list[int], int] | str | None:
    """`_fresh_pages` without waiting, in the instance's gate (held by the caller): None (nothing
    held) where it would wait for room under KV pressure or end the instance (the caller then runs
    `generate-fresh` on the instance's thread); the refusal (nothing held) where the quota or the
    pool refuses."""
    ps, rep = passes.page_size, passes.replicas[inst.pages.replica]
    pm, need = rep.pages, -(-len(tokens) // ps)
    if rep.suspender is not None and not rep.suspender.allocates_now(inst.pages, need):
        return None
    cached = pm.attach_prefix(inst.pages, tokens[:-1]) if prefix_cache and len(tokens) > ps else []
    fresh = pm.allocate(inst.pages, need - len(cached))
    if isinstance(fresh, str):
        if cached:
            pm.release(inst.pages, cached)
        # (the free pages were taken meanwhile: with a suspender, the instance's thread waits for room)
        return None if rep.suspender is not None and fresh.startswith("out of KV pages") else fresh
    return cached + fresh, len(cached) * ps


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
