"""Fake of the WIT interface `forward`: the host-side checks of a pass, then `TinyBackend.forward`.

Every pass is recorded in `requests` (also the ones that trap). The checks mirror the real host:
the page list against what the instance holds here, the rest by `gpu_backend.validate`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from inferlet import _host
from inferlet.testing.grammar import FakeMatcher, allowed_or_err, constrain
from inferlet.testing.kv import FakeKv
from inferlet.testing.records import Request, WitGeneration, WitOutput, WitOutputSpec, WitSampler, trap
from inferlet.testing.tiny import TinyBackend

from gpu_backend.types import ForwardRequest, OutputResult, OutputSpec, SamplerParams
from gpu_backend.validate import check_request

__all__ = ["FakeForward"]


def _spec(rec: WitOutputSpec) -> OutputSpec:
    s = rec.sample
    sample = (
        None
        if s is None
        else SamplerParams(
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, seed=s.seed
        )
    )
    return OutputSpec(index=rec.index, sample=sample, dist=rec.dist)


class FakeForward:
    Sampler, OutputSpec, Output = WitSampler, WitOutputSpec, WitOutput

    def __init__(self, kv: FakeKv, backend: TinyBackend, send: Callable[[str], None] = print) -> None:
        self.kv, self.backend, self.send = kv, backend, send
        self.requests: list[Request] = []
        self.results: dict[int, list[WitOutput]] = {}
        self.next_handle = 1
        self.decode_step_calls = 0  # passes that came through decode_step (also in `requests`)
        self.generate_calls = 0  # host-side generation loops (their passes are in `requests`)
        self.generate_fresh_calls = 0  # of which started by generate_fresh (pages taken by the host)
        self._matcher: FakeMatcher | None = None  # the matcher of the generate-constrained running

    @property
    def script(self) -> list[int]:
        """When set, sampled tokens are taken from here in order (`TinyBackend.script`)."""
        return self.backend.script

    @script.setter
    def script(self, tokens: list[int]) -> None:
        self.backend.script = list(tokens)

    def run(self, pages, last_page_len, tokens, positions, mask, outputs) -> list[WitOutput]:  # noqa: ANN001
        return [WitOutput(r.token, r.ids, r.probs)
                for r in self._run(pages, last_page_len, tokens, positions, mask, outputs, None)]

    def run_scored(self, pages, last_page_len, tokens, positions, mask, outputs,  # noqa: ANN001
                   targets) -> tuple[list[WitOutput], list[float]]:  # noqa: ANN001
        if len(targets) != len(outputs):
            raise trap("forward.run-scored", f"{len(targets)} targets for {len(outputs)} outputs")
        result = self._run(pages, last_page_len, tokens, positions, mask, outputs, list(targets))
        return [WitOutput(r.token, r.ids, r.probs) for r in result], [float(r.logprob or 0.0) for r in result]

    def _run(self, pages, last_page_len, tokens, positions, mask, outputs,  # noqa: ANN001
             targets: list[int] | None) -> list[OutputResult]:
        rec = Request(
            list(pages), last_page_len, list(tokens), list(positions), [list(r) for r in mask], list(outputs)
        )
        self.requests.append(rec)
        specs = [_spec(o) for o in rec.outputs]
        if targets is not None:
            specs = [replace(o, target=t) for o, t in zip(specs, targets, strict=True)]
        req = ForwardRequest(rec.pages, rec.last_page_len, rec.tokens, rec.positions, rec.mask or None, specs,
                             name="fake-instance")
        self._check(req)
        try:
            (result,) = self.backend.forward([check_request(req, self.backend.info)])
        except ValueError as e:  # from check_request, or a ForwardError from the backend
            raise trap("forward", str(e)) from None
        return result

    def _check(self, req: ForwardRequest) -> None:
        """What the host checks before the validator: page list, lengths, holds, mask shape."""
        ps, kv, n = self.kv.ps, self.kv, len(req.tokens)
        if not req.pages or not 1 <= req.last_page_len <= ps:
            raise trap(
                "forward", f"last-page-len {req.last_page_len} out of 1..{ps} ({len(req.pages)} pages)"
            )
        total, ctx = req.total_len(ps), req.context_len(ps)
        if ctx < 0 or len(req.positions) != n:
            raise trap("forward", f"{n} tokens / {len(req.positions)} positions do not fit {total} slots")
        for p in req.pages:
            if p not in kv.held:
                raise trap("forward", f"page {p} is not held by this instance")
        rows = req.mask or []
        if rows and len(rows) != n:
            raise trap("forward", f"mask has {len(rows)} rows for {n} tokens")
        for i, row in enumerate(rows):
            if sum(row) != ctx + i + 1 or min(row, default=0) < 0:
                raise trap("forward", f"mask row {i} sums to {sum(row)}, expected {ctx + i + 1}")
        for page in req.pages[req.first_written_page(ps) :]:
            if page not in kv.owned:
                raise trap("forward", f"page {page} is read-only (imported)")
        for spec in req.outputs:
            if not 0 <= spec.index < n:
                raise trap("forward", f"output index {spec.index} out of 0..{n - 1}")

    def decode_step(self, pages, last_page_len, token, position, sampler) -> int:  # noqa: ANN001
        self.decode_step_calls += 1
        out = self.run(pages, last_page_len, [token], [position], [], [WitOutputSpec(0, sampler, 0)])
        assert out[0].token is not None
        return out[0].token

    def submit(self, *args: Any) -> int:
        h = self.next_handle
        self.next_handle += 1
        self.results[h] = self.run(*args)
        return h

    def wait(self, handle: int) -> list[WitOutput]:
        if handle not in self.results:
            raise trap("forward.wait", f"unknown handle {handle}")
        return self.results.pop(handle)

    def wait_any(self, handles: list[int]) -> tuple[int, list[WitOutput]]:
        h = max(handles)  # the newest: callers must not rely on submission order
        return h, self.wait(h)

    def generate(self, pages, last_page_len, tokens, positions, sampler, max_tokens, stop_tokens,  # noqa: ANN001
                 stop_strings, stream) -> WitGeneration:  # noqa: ANN001
        """The host-side loop, written out plainly: one `run` per token, the documented stop order."""
        self.generate_calls += 1
        if max_tokens < 1 or any(not s for s in stop_strings):
            raise trap("forward.generate", f"bad max-tokens {max_tokens} or an empty stop string")
        pages, toks, poss, last = list(pages), list(tokens), list(positions), last_page_len
        drawn: list[int] = []
        new_pages: list[int] = []
        sent = 0
        while True:
            seed = None if sampler.seed is None else (sampler.seed + len(drawn)) % 2**64
            s = WitSampler(sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p, seed)
            spec = [WitOutputSpec(len(toks) - 1, s, 0)]
            try:
                out = self.run(pages, last, toks, poss, [], spec) if self._matcher is None else \
                    self.run_constrained(pages, last, toks, poss, [], spec, 0, self._matcher)
            except _host.Err:  # the grammar admits no token: undo this call's pages
                self.kv.release(new_pages)
                raise
            drawn.append(out[0].token)
            finish, trim = self._stop(drawn, max_tokens, stop_tokens, stop_strings)
            if stream:
                text = self.backend.tokenizer.decode(drawn[: len(drawn) - trim])
                if len(text) > sent:
                    self.send(text[sent:])
                    sent = len(text)
            if finish is not None:
                return WitGeneration(drawn, new_pages, trim, finish)
            if last == self.kv.ps:
                try:
                    (page,) = self.kv.allocate(1)
                except _host.Err:
                    return WitGeneration(drawn, new_pages, 0, "out-of-pages")
                pages.append(page)
                new_pages.append(page)
                last = 1
            else:
                last += 1
            toks, poss = [drawn[-1]], [poss[-1] + 1]

    def generate_fresh(self, tokens, sampler, max_tokens, stop_tokens, stop_strings, stream,  # noqa: ANN001
                       prefix_cache) -> WitGeneration:  # noqa: ANN001
        """`generate` over pages it takes itself: the (fake, empty) prefix cache's, then fresh ones."""
        self.generate_fresh_calls += 1
        if not tokens or max_tokens < 1 or any(not s for s in stop_strings):
            raise trap("forward.generate-fresh", f"no tokens, bad max-tokens {max_tokens} or an empty stop string")
        ps = self.kv.ps
        cached = self.kv.attach_prefix(list(tokens[:-1])) if prefix_cache and len(tokens) > ps else []
        try:
            fresh = self.kv.allocate(-(-len(tokens) // ps) - len(cached))
        except _host.Err:
            if cached:
                self.kv.release(cached)
            return WitGeneration([], [], 0, "out-of-pages")
        pages, done = cached + fresh, len(cached) * ps
        g = self.generate(pages, len(tokens) - (len(pages) - 1) * ps, tokens[done:], list(range(done, len(tokens))),
                          sampler, max_tokens, stop_tokens, stop_strings, stream)
        return WitGeneration(g.tokens, pages + g.new_pages, g.trim, g.finish)

    def run_constrained(self, pages, last_page_len, tokens, positions, mask, outputs, constrained,  # noqa: ANN001
                        matcher: FakeMatcher) -> list[WitOutput]:
        """`run` with output `constrained` drawn from what `matcher` allows; the matcher accepts it."""
        if constrained >= len(outputs) or outputs[constrained].sample is None:
            raise trap("forward.run-constrained", f"constrained output {constrained} samples no token")
        allowed = allowed_or_err(matcher)
        out = self.run(pages, last_page_len, tokens, positions, mask, outputs)
        o = out[constrained]
        token = constrain(o.token, allowed)
        out[constrained] = WitOutput(token, o.ids, o.probs)
        matcher.m.accept(token)
        return out

    def submit_constrained(self, *args: Any) -> int:
        h = self.next_handle
        self.next_handle += 1
        self.results[h] = self.run_constrained(*args)
        return h

    def decode_step_constrained(self, pages, last_page_len, token, position, sampler,  # noqa: ANN001
                                matcher: FakeMatcher) -> int:
        self.decode_step_calls += 1
        spec = [WitOutputSpec(0, sampler, 0)]
        out = self.run_constrained(pages, last_page_len, [token], [position], [], spec, 0, matcher)
        return out[0].token

    def generate_constrained(self, pages, last_page_len, tokens, positions, sampler, max_tokens,  # noqa: ANN001
                             stop_tokens, stop_strings, stream, matcher: FakeMatcher) -> WitGeneration:  # noqa: ANN001
        """`generate` drawing every token from what `matcher` allows, also ending on the model's stop tokens."""
        start, self._matcher = matcher.m.accepted, matcher
        stops = list(stop_tokens) + list(self.backend.info.stop_tokens)
        try:
            return self.generate(pages, last_page_len, tokens, positions, sampler, max_tokens, stops,
                                 stop_strings, stream)
        except _host.Err:
            matcher.m.rollback(matcher.m.accepted - start)
            raise
        finally:
            self._matcher = None

    def _stop(self, drawn: list[int], max_tokens: int, stop_tokens: list[int],
              stop_strings: list[str]) -> tuple[str | None, int]:
        if len(drawn) >= max_tokens:
            return "length", 0
        if drawn[-1] in stop_tokens:
            return "stop-token", 1
        text = self.backend.tokenizer.decode(drawn)
        if any(s in text for s in stop_strings):
            return "stop-string", 0
        return None, 0
