"""Host-side generation loops (WIT `forward.generate`): decode steps with no guest wake-up per token.

A `Generation` is one sequence the scheduler keeps in every batch until it stops: after each
step it takes the drawn token, checks the stop rules, grows the page list from its instance's
quota, and turns its (reused) request into the next step. All of that runs on the scheduler
thread between two backend calls, so it is kept to a few attribute updates per token.

Most steps are the same few updates: no stop rule can apply but the stop tokens, no page fills,
nothing streams. `Generation.fast` counts how many steps in a row are of that kind from here;
the scheduler does those inline (`Loops.step_loops`), without a call per loop, and `advance`
does the others and counts again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host.state.pages import InstancePages, PageError, PageManager

__all__ = ["Generation", "GenerationResult", "StopRules"]

U64 = 2**64


@dataclass(frozen=True)
class StopRules:
    """When a generation ends, checked in this order after every token."""

    max_tokens: int
    stop_tokens: frozenset[int]
    stop_strings: tuple[str, ...]
    max_position: int  # positions must stay below it


@dataclass
class GenerationResult:
    tokens: list[int]
    new_pages: list[int]
    trim: int
    finish: str  # length | stop-token | stop-string | out-of-pages | max-position | cancelled


class Generation:
    """One host-side generation loop. `advance` is called with each drawn token, on the scheduler thread.

    `fast`: how many of the next steps, in a row, need only this when their token is not a stop
    token: append it to `tokens`, write it and the next position into the request, one more slot
    in the last page (`fast_step`, which counts `fast` down; `advance` sets it).
    0 while streaming, with stop strings or a seed, and for subclasses that do more per step."""

    FAST_STEPS = True  # False: every step goes through `advance` (a subclass with its own per-step work)
    AHEAD = True  # False: the next step needs the token first (a subclass whose step depends on it)

    def __init__(self, request: ForwardRequest, sampler: SamplerParams, rules: StopRules, page_size: int,
                 pages: PageManager, table: InstancePages, decode: Callable[[list[int]], str],
                 send: Callable[[str], None] | None) -> None:
        self.request = request  # the next step's pass; mutated in place from step to step
        self.sampler = sampler
        self.rules = rules
        self.page_size = page_size
        self._pm, self._table = pages, table
        self._decode = decode
        self._send = send
        self._sent = 0
        self.tokens: list[int] = []
        self.new_pages: list[int] = []
        self.result: GenerationResult | None = None
        self.cancelled = False  # set by the instance when it stops waiting (terminated, out of budget)
        self.cancelled_as = "cancelled"
        # with a seed, step i draws with seed + i (as the SDK's own loop does)
        self._seeded = sampler.seed is not None
        # The first step (noted by its submitter) writes up to slot `_base`; drawn token i goes to
        # slot _base + i at position _base + i + _pos_off. The steps' writes are noted a page at a
        # time (`note_writes`): slots below `_noted` are.
        self._base = request.context_len(page_size) + len(request.tokens)
        self._pos_off = request.positions[-1] + 1 - self._base
        self._noted = self._base
        # `rules.stop_tokens` again, read by every fast step: one object fewer to reach per loop
        # (through `rules`: the scheduler's work after a batch of 256 read 0.40 ms vs 0.26)
        self.stop_tokens = rules.stop_tokens
        self.fast = 0  # the first step (all the pending tokens) goes through `advance`
        # may the scheduler prepare the next step before this one's token is known? Not with stop
        # strings: whether one ends the loop is known only from the decoded text
        self.ahead = self.AHEAD and not rules.stop_strings

    def cancel(self, finish: str = "cancelled") -> None:
        """Its caller has gone (terminated, out of budget): the loop ends at its next step. With
        finish `out-of-pages`: its instance is being suspended (host/suspend.py), the SDK goes on."""
        self.cancelled_as = finish
        self.cancelled = True

    def fast_step(self, token: int) -> None:
        """A step while `fast` > 0: `token` (no stop token) is taken and the request moves one position
        and one slot on, writing it. What `advance` and `took` + `prepare` do for such a step."""
        self.fast -= 1
        self.tokens.append(token)
        req = self.request
        req.tokens[0] = token
        req.positions[0] += 1
        req.last_page_len += 1

    def advance(self, token: int) -> bool:
        """Take the token drawn by the last step; True when the generation has ended (see `result`).

        The common step (no stop, no stream, no seed, the page not full) is a handful of attribute
        updates: with 256 loops in a batch this runs 256 times between two backend calls."""
        if self.cancelled:
            return self._end(self.cancelled_as)
        tokens = self.tokens
        tokens.append(token)
        rules = self.rules
        if len(tokens) >= rules.max_tokens:
            finish, trim = "length", 0
        elif token in rules.stop_tokens:
            finish, trim = "stop-token", 1
        elif rules.stop_strings and self._stop_string(tokens):
            finish, trim = "stop-string", 0
        else:
            finish, trim = None, 0
        if self._send is not None:
            self._stream(tokens, trim)
        if finish is not None:
            self.result = GenerationResult(tokens, self.new_pages, trim, finish)
            return True
        return self._next_step(token)

    def _stop_string(self, tokens: list[int]) -> bool:
        stops = self.rules.stop_strings
        tail = self._decode(tokens[-max(len(s.encode()) + 4 for s in stops):])
        return any(s in tail for s in stops)

    def _stream(self, tokens: list[int], trim: int) -> None:
        text = self._decode(tokens[: len(tokens) - trim])
        if len(text) > self._sent:
            assert self._send is not None
            self._send(text[self._sent:])
            self._sent = len(text)

    def _next_step(self, token: int) -> bool:
        """Turn the request into the step that writes `token`; False if it can, else end the loop."""
        why = self._extend(token, len(self.tokens))
        if why is not None:
            return self._end(why)
        req, ps = self.request, self.page_size
        if req.last_page_len == ps:  # this step fills its page: the page's writes are noted now
            self.note_writes()
        if self.FAST_STEPS and self._send is None and not self._seeded and not self.rules.stop_strings:
            # the next fast steps: each appends a token (the `length` rule), moves the position
            # (`max-position`) and fills one more slot, without filling the page (its writes are noted then)
            self.fast = min(self.rules.max_tokens - 1 - len(self.tokens), self.rules.max_position - 1 - req.positions[0],
                            ps - 1 - req.last_page_len)
        return False

    def _extend(self, token: int, drawn: int) -> str | None:
        """Turn the request into the step after it, which writes `token` one slot on and draws token
        number `drawn` (its seed); returns why it cannot (`max-position`, `out-of-pages`), untouched."""
        req = self.request
        position = req.positions[-1] + 1
        if position >= self.rules.max_position:
            return "max-position"
        ps = self.page_size
        if req.last_page_len == ps:
            got = self._pm.allocate(self._table, 1)
            if isinstance(got, str):
                return "out-of-pages"
            page = self._pm.to_phys(self._table, got)[0]  # (`got`: the guest's id for it)
            self._pm.pin([page])  # like the pages it started with: not freed while the loop may write it
            req.pages.append(page)
            self.new_pages.append(got[0])
            req.last_page_len = 1
        else:
            req.last_page_len += 1
        if len(req.tokens) == 1:
            req.tokens[0] = token
            req.positions[0] = position
        else:  # after the first step (all pending tokens), every step is one token
            req.tokens, req.positions = [token], [position]
            req.outputs = [OutputSpec(index=0, sample=self.sampler)]
        if self._seeded:
            seed = (self.sampler.seed + drawn) % U64  # type: ignore[operator]
            req.outputs = [OutputSpec(index=0, sample=replace(self.sampler, seed=seed))]
        return None

    # ---- ahead: the next step prepared while the last one runs ----
    # With a backend that overlaps (`start_forward`), the scheduler launches a loop's next step as
    # soon as the token it writes is drawn: the step was prepared (position, page) while the batch
    # drawing that token ran, and the scheduler writes the token in, or leaves the loop out when
    # the token is a stop token or the loop was cancelled (host/batching/scheduler.py). After each
    # launch the loop takes the token its launched step writes (`took`, or the scheduler inline
    # while `fast`) and prepares the step after (`prepare`); a left-out loop ends (`finish`).
    # `fast` counts, in this mode, the coming took+prepare rounds that are a token appended, one
    # position and one slot on: no page filled or started, no stream, no seed, not the last step.

    def prepare(self) -> bool:
        """Turn the request (the step just launched) into the next one, its token left for the
        scheduler to write in; False when there is no next step: the token this one draws is the
        last, or no position or page is left for it (`finish` then ends the loop, or it goes on)."""
        if len(self.tokens) + 2 > self.rules.max_tokens:
            return False
        if self._extend(0, len(self.tokens) + 1) is not None:
            return False
        if self.FAST_STEPS and self._send is None and not self._seeded:
            req = self.request
            self.fast = max(0, min(self.page_size - req.last_page_len, self.rules.max_position - 1 - req.positions[0],
                                   self.rules.max_tokens - 2 - len(self.tokens)))
        return True

    def took(self, token: int) -> bool:
        """The launched step writes `token` (no stop token: the scheduler checked): take it, note the
        page it fills, and `prepare` the next step (its result)."""
        self.tokens.append(token)
        if self._send is not None:
            self._stream(self.tokens, 0)
        if self.request.last_page_len == self.page_size:
            self.note_writes()
        return self.prepare()

    def unprepare(self) -> None:
        """Take back a prepared step that was not launched: the request is the last launched step again
        (a page it started is given back)."""
        req = self.request
        if req.last_page_len == 1:  # the prepared step started this page (a launched step writes >= 1 slot)
            page = req.pages.pop()
            guest_id = self.new_pages.pop()
            try:
                self._pm.release(self._table, [guest_id])
            except PageError:  # the instance has ended and dropped its pages already
                pass
            self._pm.unpin([page])
            req.last_page_len = self.page_size
        else:
            req.last_page_len -= 1
        req.positions[0] -= 1

    def finish(self, token: int | None, prepared: bool) -> bool:
        """The loop was left out of the next batch (`token`, drawn by its last launched step, is a
        stop token, or it was cancelled), or that step was its last: `advance` decides, from the
        last launched step. True when it has ended; else it goes on, one step at a time (a page
        refused to `prepare` may be free now)."""
        if prepared:
            self.unprepare()
        if token is None and not self.cancelled:
            raise RuntimeError("the backend drew no token for a generation step")
        return self.advance(token)  # type: ignore[arg-type]  # (None only when cancelled: not read)

    def note_writes(self) -> None:
        """Note the writes of the steps made so far that are not noted yet (`PageManager.note_run`):
        when a step fills its page, and when the loop ends, however it ends (the scheduler calls
        it then, before the pages' content may be forgotten)."""
        req, ps = self.request, self.page_size
        end = (len(req.pages) - 1) * ps + req.last_page_len  # after the slot the last step writes
        # (a loop cancelled after a launch: that step's token was never taken, nor is its slot noted)
        end = min(end, self._base + len(self.tokens))
        start = self._noted
        if end > start:
            self._noted = end
            tokens = self.tokens[start - self._base : end - self._base]
            self._pm.note_run(self._table, req.pages, ps, start, tokens, start + self._pos_off)

    def _end(self, finish: str) -> bool:
        if self.cancelled:
            self._give_back_unused()
        self.result = GenerationResult(self.tokens, self.new_pages, 0, finish)
        return True

    def _give_back_unused(self) -> None:
        """A cancelled loop ends with the pages its caller resumes from: those holding the pending
        tokens and every drawn token but the last (which the caller writes next). A page started for
        a step that ran but whose token was never taken goes back (it stays in the request, pinned
        until the loop's job ends; `note_writes` notes nothing in it)."""
        extra = len(self.request.pages) - -(-(self._base + len(self.tokens)) // self.page_size)
        for _ in range(min(extra, len(self.new_pages))):
            page = self.new_pages.pop()
            try:
                self._pm.release(self._table, [page])
            except PageError:  # the instance has ended and dropped its pages already
                pass
