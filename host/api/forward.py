"""WIT interface `forward`: submit forward passes, wait on one or any, the one-token decode step, and
the host-side generation loop (`generate`, 0.2.0).

Each pass is checked here, once, where it enters the host: the page list against what the
instance holds, the rest by `gpu_backend.validate.check_request` (the backend trusts a checked
request). `decode-step` checks its fixed shape inline instead: it is the call made per token.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from wasmtime.component import Record

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, OutputSpec, SamplerParams, Tokenizer
from gpu_backend.validate import as_sampler, check_request
from host.api.guest import GuestError, Import, guest_import
from host.batching.future import ForwardFuture
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

    def __init__(self, pm: PageManager, scheduler: Scheduler, info: BackendInfo, lookahead: bool = True) -> None:
        self.pm, self.scheduler, self.info = pm, scheduler, info
        self.lookahead = lookahead  # run a stepping guest's predicted next decode-step ahead (_Stepper)
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

    def admit(self, inst: Instance, req: ForwardRequest) -> ForwardRequest:
        """The boundary check of a pass a guest asked for: its pages (`check_pages`), then everything
        else (`check_request`: the request comes back checked), then its writes noted for the prefix
        cache. Every forward import admits its request here (decode steps: `decode_request`)."""
        ctx = self.check_pages(inst, req.pages, req.last_page_len, len(req.tokens))
        req = check_request(req, self.info)
        self.pm.note_write(inst.pages, req, self.page_size, context_len=ctx)
        return req

    def submit(self, inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
               mask: list[list[int]], outputs: list[Any]) -> int:
        req = self.admit(inst, ForwardRequest(pages=pages, last_page_len=last_len, tokens=tokens, positions=positions,
                                              mask=mask or None, outputs=_outputs(outputs), name=inst.label))
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
                       sampler: Any, key: tuple[Any, ...]) -> ForwardRequest:
        """forward.run(pages, last_len, [token], [position], [], [sample-only spec at 0]), checked
        inline: everything check_request would reject, for this fixed shape (the call made per token).
        `key`: the sampler's fields, as a tuple."""
        ctx = self.check_pages(inst, pages, last_len, 1, step=True)  # no page repeated either
        if token >= self.info.vocab_size:
            raise GuestError(f"token {token} is outside the vocabulary (size {self.info.vocab_size})")
        if position >= self.max_position:
            raise GuestError(f"position {position} is past the model's maximum {self.max_position - 1}")
        outputs = self.decode_specs.get(key)
        if outputs is None:
            outputs = [OutputSpec(index=0, sample=as_sampler(_sampler(sampler), "sampler"))]
            if len(self.decode_specs) < 1024:
                self.decode_specs[key] = outputs
        req = ForwardRequest(pages=pages, last_page_len=last_len, tokens=[token], positions=[position],
                             outputs=outputs, name=inst.label, checked=True)
        self.pm.note_write(inst.pages, req, self.page_size, context_len=ctx)
        return req


TRUST = 2  # a guest's decode-steps must have matched the prediction this many times in a row


class _Stepper:
    """Lookahead for a guest that steps every token itself (`decode-step`): its next step is run
    in the batch after the one that drew its token, while the guest runs, instead of one later.

    Every step costs a stepping guest a wake-up, its own code and a new submit; the batch waits
    for all that (~100 us per instance and token on 2 vCPUs, serialized by the GIL), so with many
    instances the backend idles (issue 12). The host predicts the next call: the same pages and
    sampler, the token just drawn, at the next position and the next slot of the last page. Once
    TRUST calls in a row have been the predicted ones, the scheduler thread queues the prediction
    when the step before it ends, before anyone wakes (`ForwardFuture.follow`; it takes over that
    step's page pins). The guest's next `decode-step` claims it if its arguments are exactly the
    predicted ones; otherwise the prediction is withdrawn if still queued (or its result dropped)
    and the call runs as usual, and trust starts again from 0. Any other `forward` or `kv` call of
    the instance first drops the prediction (host/api/guest.py): its view of its pages may then
    differ from the one the prediction was made on. A prediction never crosses a page boundary
    (the guest allocates that page) nor the model's last position.

    What a prediction writes before it is claimed is the K/V of the drawn token in the next slot
    of the instance's own last page, a slot the guest has never written since it allocated the
    page (`PageManager.filled`; a guest that went back to an earlier position is not run ahead
    over what it wrote there) and the one its next step writes: nobody else can write or free
    the page (pinned), and the prefix cache learns of the write only when the guest claims it. A claimed prediction is
    the guest's own call with the same inputs: the outputs are the same.
    """

    __slots__ = ("passes", "inst", "lock", "closed", "trust", "pending", "dropped", "key", "e_pages", "e_len",
                 "e_token", "e_pos")

    def __init__(self, passes: _Passes, inst: Instance) -> None:
        self.passes, self.inst = passes, inst
        self.lock = threading.Lock()  # pending / closed between the guest thread and the scheduler's follow-up
        self.closed = False  # the instance is ending: predict nothing more
        self.trust = 0
        self.pending: ForwardFuture | None = None  # the queued prediction (or run, not yet claimed)
        self.dropped: ForwardFuture | None = None  # the last prediction dropped while it ran
        self.key: tuple[Any, ...] = ()  # the sampler of the last call
        # the predicted next call, from the last one: pages (None: no prediction), last-page-len (0: the
        # pages plus one new page, last-page-len 1), token, position
        self.e_pages: list[int] | None = None
        self.e_len = 0
        self.e_token = -1
        self.e_pos = -1

    def step(self, pages: list[int], last_len: int, token: int, position: int, sampler: Any) -> int:
        """forward.decode-step: claim the prediction if these are its arguments, else submit."""
        inst, passes = self.inst, self.passes
        key = tuple(sampler.__dict__.values())
        fut = self.pending
        if fut is not None:
            self.pending = None
            req = fut.request
            assert isinstance(req, ForwardRequest)
            if (token == req.tokens[0] and position == req.positions[0] and last_len == req.last_page_len
                    and key == self.key and pages == req.pages):
                ctx = passes.check_pages(inst, pages, last_len, 1, step=True)  # as for any step
                passes.pm.note_write(inst.pages, req, passes.page_size, context_len=ctx)
                self.trust += 1
            else:
                if not passes.scheduler.withdraw(fut):  # if still queued; else its result is dropped
                    self.dropped = fut
                self.trust = 0
                fut = None
        elif (token == self.e_token and position == self.e_pos and key == self.key and self._expected(pages, last_len)):
            self.trust += 1
        else:
            self.trust = 0
        if fut is None:
            fut = passes.scheduler.submit(
                passes.decode_request(inst, pages, last_len, token, position, sampler, key), inst.id)
        self.key = key
        trusted = self.trust >= TRUST and passes.lookahead
        if trusted:
            fut.follow = self.follow
        # (terminated or out of budget: nothing more ahead)
        out: int | None = inst.wait_for(fut, lambda: setattr(fut, "follow", None))[0].token
        assert out is not None  # the spec asked for a sampled token
        if trusted and fut.follow is not None:  # done before this thread set it: queue the prediction here
            fut.follow = None
            self._queue(fut, out)
        self.e_pages, self.e_token, self.e_pos = pages, out, position + 1
        self.e_len = last_len + 1 if last_len < passes.page_size else 0
        return out

    def _expected(self, pages: list[int], last_len: int) -> bool:
        e = self.e_pages
        if e is None:
            return False
        if self.e_len:
            return last_len == self.e_len and pages == e
        return last_len == 1 and len(pages) == len(e) + 1 and pages[:-1] == e

    def _advance(self, req: ForwardRequest, token: int | None) -> bool:
        """Turn the done step `req` into the predicted next one, if there can be one."""
        passes = self.passes
        if (token is None or token >= passes.info.vocab_size or req.last_page_len >= passes.page_size
                or req.positions[0] + 1 >= passes.max_position or self.closed or self.pending is not None
                or passes.pm.filled(self.inst.pages, req.pages[-1]) > req.last_page_len):
            return False  # (the last: the guest wrote that slot before, and may still count on it)
        req.last_page_len += 1
        req.tokens[0] = token
        req.positions[0] += 1
        return True

    def follow(self, fut: ForwardFuture, outputs: list[OutputResult]) -> ForwardFuture | None:
        """The scheduler thread's follow-up of a trusted step: the prediction, to queue now."""
        req = fut.request
        assert isinstance(req, ForwardRequest)
        with self.lock:
            if not self._advance(req, outputs[0].token):
                return None
            self.pending = ForwardFuture(req, fut.owner)
            return self.pending

    def _queue(self, fut: ForwardFuture, token: int) -> None:
        """The prediction after a step that ended before its follow-up was set: submitted from here."""
        req = fut.request
        assert isinstance(req, ForwardRequest)
        with self.lock:
            if self._advance(req, token):
                self.pending = self.passes.scheduler.submit(req, fut.owner, lookahead=True)

    def drop(self) -> None:
        """Another forward or kv call (or the instance's end): forget the prediction (withdrawn if
        still queued; one already running is kept in `dropped` until it ends)."""
        if self.pending is None and self.e_pages is None:
            return
        with self.lock:
            fut, self.pending = self.pending, None
            self.e_pages = None
            self.trust = 0
        if fut is not None and not self.passes.scheduler.withdraw(fut):
            self.dropped = fut  # the owner's later jobs run after it anyway (same owner, in order)

    def close(self) -> ForwardFuture | None:
        """The instance ends: no more predictions. Returns one still running: its pages stay pinned
        until it ends, so the end waits for it as for the instance's other forwards."""
        with self.lock:
            self.closed = True
        self.drop()
        fut, self.dropped = self.dropped, None
        return fut if fut is not None and not fut.done() else None


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
    req = passes.admit(inst, ForwardRequest(pages=list(pages), last_page_len=last_len, tokens=tokens,
                                            positions=positions, name=inst.label,
                                            outputs=[OutputSpec(index=len(tokens) - 1, sample=sample)]))
    rules = StopRules(max_tokens, frozenset(stop_tokens), tuple(stop_strings), passes.max_position)
    send = (lambda text: inst.emit("message", text)) if stream else None
    # the loop pins, notes and grows pages on its instance's own page manager (its replica's)
    return make(req, sample, rules, passes.page_size, passes.pm.manager(inst.pages), inst.pages, tok.decode, send)


def _generation_record(res: GenerationResult) -> Record:
    rec = Record()
    rec.__dict__.update({"tokens": res.tokens, "new-pages": res.new_pages, "trim": res.trim, "finish": res.finish})
    return rec


def imports(pm: PageManager, scheduler: Scheduler, info: BackendInfo, tok: Tokenizer,
            lookahead: bool = True) -> dict[str, Import]:
    """The `forward` imports; `lookahead`: run a stepping guest's predicted next step ahead (`_Stepper`)."""
    passes = _Passes(pm, scheduler, info, lookahead)

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
        stepper = inst.stepper
        if stepper is None:
            stepper = inst.stepper = _Stepper(passes, inst)
        out: int = stepper.step(pages, last_len, token, position, sampler)
        return out

    def run_generation(inst: Instance, gen: Generation, first_pages: list[int]) -> Record:
        result: GenerationResult = inst.wait_for(scheduler.submit(gen.request, inst.id, generation=gen),
                                                 gen.cancel)
        if first_pages:
            result = dataclasses.replace(result, new_pages=first_pages + result.new_pages)
        return _generation_record(result)

    @guest_import("forward.generate")
    def generate(inst: Instance, *args: Any) -> Record:
        return run_generation(inst, _generation(passes, tok, inst, *args), [])

    @guest_import("forward.generate-fresh")
    def generate_fresh(inst: Instance, tokens: list[int], sampler: Any, max_tokens: int, stop_tokens: list[int],
                       stop_strings: list[str], stream: bool, prefix_cache: bool) -> Record:
        first = _fresh_pages(passes, inst, tokens, prefix_cache)
        if first is None:
            return _generation_record(GenerationResult([], [], 0, "out-of-pages"))
        pages, cached = first
        try:
            gen = _generation(passes, tok, inst, pages, len(tokens) - (len(pages) - 1) * passes.page_size,
                              tokens[cached:], list(range(cached, len(tokens))), sampler, max_tokens, stop_tokens,
                              stop_strings, stream)
        except BaseException:
            passes.pm.release(inst.pages, pages)  # a bad argument: the caller traps holding nothing new
            raise
        return run_generation(inst, gen, pages)

    return {"submit": submit, "wait": wait, "wait-any": wait_any, "run": run, "decode-step": decode_step,
            "generate": generate, "generate-fresh": generate_fresh}


def _fresh_pages(passes: _Passes, inst: Instance, tokens: list[int], prefix_cache: bool) \
        -> tuple[list[int], int] | None:
    """`forward.generate-fresh`'s pages for `tokens` at positions 0..: the prefix cache's pages for
    the longest full-page prefix of all but the last token, then fresh ones from the instance's
    quota; with how many tokens the cached pages hold. None (nothing held) if the quota or the
    pool refuses."""
    inst.check_alive()
    if not tokens:
        raise GuestError("no pending tokens to start from")
    ps, pm = passes.page_size, passes.pm
    cached = pm.attach_prefix(inst.pages, tokens[:-1]) if prefix_cache and len(tokens) > ps else []
    fresh = pm.allocate(inst.pages, -(-len(tokens) // ps) - len(cached))
    if isinstance(fresh, str):
        if cached:
            pm.release(inst.pages, cached)
        return None
    return cached + fresh, len(cached) * ps
