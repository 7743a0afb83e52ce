"""WIT interface `forward`, its structured-generation functions (0.2.0): `run-constrained`,
`submit-constrained`, `decode-step-constrained` and `generate-constrained`.

Each fills the matcher's token mask on the host right before its pass is queued (the matcher cannot
change until the pass is done: it is `busy`), puts it in the sampled output's `OutputSpec.allowed`
(applied on the backend's device, in the batch), and accepts the drawn token on the host: when the
pass completes (submit / run), after the step (decode-step), or on the scheduler thread after every
step of the host-side loop (generate, host/batching/constrained.py). A grammar that admits no token
comes back as the WIT error, before any pass runs or, in a loop, with its pages released.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from wasmtime.component import Record, ResourceAny

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, Tokenizer
from host.api.grammar import Grammars, HostMatcher
from host.api.guest import GuestError, Import, guest_import
from host.api.passes import Passes, generation, generation_record, outputs_of
from host.batching.constrained import GRAMMAR_ERROR, ConstrainedGeneration, allowed_mask
from host.batching.future import ForwardFuture
from host.batching.generation import GenerationResult
from host.replicas import Replica
from host.wasm.instance import Instance

__all__ = ["imports"]

log = logging.getLogger(__name__)


def _accept_when_done(m: HostMatcher, index: int) -> Any:
    """A done-callback (scheduler thread): the matcher accepts output `index`'s drawn token, then is idle."""

    def done(fut: ForwardFuture) -> None:
        try:
            outputs = fut.wait()
        except Exception:  # the pass failed: its waiter gets the error; the matcher is unchanged
            m.busy = False
            return
        token = outputs[index].token
        if not m.matcher.accept(token):
            log.error("a matcher refused token %s drawn from its own mask", token)
        m.busy = False

    return done


def imports(replicas: Sequence[Replica], info: BackendInfo, tok: Tokenizer,
            grammars: Grammars) -> dict[str, Import]:
    passes = Passes(replicas, info)

    def submit(inst: Instance, store: Any, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
               mask: list[list[int]], outputs: list[Any], constrained: int, handle: ResourceAny) -> int | str:
        m = grammars.matcher(inst, store, handle)
        if constrained >= len(outputs):
            raise GuestError(f"constrained output {constrained} is past the {len(outputs)} output specs")
        if outputs[constrained].sample is None:
            raise GuestError(f"constrained output {constrained} samples no token (its sample is none)")
        allowed = allowed_mask(m.matcher)
        if isinstance(allowed, str):
            return allowed
        specs = outputs_of(outputs)
        specs[constrained] = replace(specs[constrained], allowed=allowed)
        with passes.gate(inst):
            req = passes.admit(inst, ForwardRequest(pages=pages, last_page_len=last_len, tokens=tokens,
                                                    positions=positions, mask=mask or None, outputs=specs,
                                                    name=inst.label))
            fut = passes.scheduler(inst).submit(req, inst.id)
        m.busy = True
        fut.add_done_callback(_accept_when_done(m, constrained))  # before the waiter's wake-up
        return inst.new_handle(fut)

    @guest_import("forward.submit-constrained", store=True)
    def submit_constrained(inst: Instance, store: Any, *args: Any) -> int | str:
        return submit(inst, store, *args)

    @guest_import("forward.run-constrained", store=True)
    def run_constrained(inst: Instance, store: Any, *args: Any) -> list[OutputResult] | str:
        handle = submit(inst, store, *args)
        return handle if isinstance(handle, str) else passes.take(inst, handle)

    @guest_import("forward.decode-step-constrained", store=True)
    def decode_step_constrained(inst: Instance, store: Any, pages: list[int], last_len: int, token: int,
                                position: int, sampler: Any, handle: ResourceAny) -> int | str:
        m = grammars.matcher(inst, store, handle)
        allowed = allowed_mask(m.matcher)
        if isinstance(allowed, str):
            return allowed
        with passes.gate(inst):
            req = passes.decode_request(inst, pages, last_len, token, position, sampler,
                                        tuple(sampler.__dict__.values()))
            req.outputs = [replace(req.outputs[0], allowed=allowed)]
            fut = passes.scheduler(inst).submit(req, inst.id)
        out: int | None = inst.wait_for(fut)[0].token
        assert out is not None  # the spec asked for a sampled token
        if not m.matcher.accept(out):
            log.error("a matcher refused token %s drawn from its own mask", out)
        return out

    @guest_import("forward.generate-constrained", store=True)
    def generate_constrained(inst: Instance, store: Any, pages: list[int], last_len: int, tokens: list[int],
                             positions: list[int], sampler: Any, max_tokens: int, stop_tokens: list[int],
                             stop_strings: list[str], stream: bool, handle: ResourceAny) -> Record | str:
        m = grammars.matcher(inst, store, handle)
        allowed = allowed_mask(m.matcher)
        if isinstance(allowed, str):
            return allowed
        make = functools.partial(ConstrainedGeneration, matcher=m.matcher, first_mask=allowed)
        with passes.gate(inst):
            gen = generation(passes, tok, inst, pages, last_len, tokens, positions, sampler, max_tokens,
                              stop_tokens, stop_strings, stream, make=make)
            assert isinstance(gen, ConstrainedGeneration)
            fut = passes.scheduler(inst).submit(gen.request, inst.id, generation=gen)
            inst.pages.loop = gen  # (ended with out-of-pages if the instance is suspended: host/suspend.py)
        m.busy = True
        try:
            result: GenerationResult = inst.wait_for(fut, gen.cancel)
        finally:
            m.busy = not fut.done()
            inst.pages.loop = None
        if result.finish == GRAMMAR_ERROR:  # undo the call: its pages and what the matcher accepted
            with passes.gate(inst):
                passes.pm(inst).release(inst.pages, result.new_pages)
            m.matcher.rollback(gen.accepted)
            return gen.error or "the grammar admits no token here"
        return generation_record(result)

    return {"run-constrained": run_constrained, "submit-constrained": submit_constrained,
            "decode-step-constrained": decode_step_constrained, "generate-constrained": generate_constrained}
