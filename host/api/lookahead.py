"""Lookahead for a guest that steps every token itself (`forward.decode-step`): its predicted next
step runs in the batch after the one that drew its token (`Stepper`). Which imports leave a
prediction valid is declared where each import is registered (`guest_import(..., keeps_lookahead=
True)`); every other `forward` and `kv` import drops it first (host/api/guest.py).
"""

from __future__ import annotations

import threading
from typing import Any

from gpu_backend.types import ForwardRequest, OutputResult
from host.api.passes import Passes
from host.batching.future import ForwardFuture
from host.wasm.instance import Instance

__all__ = ["Stepper", "TRUST"]


TRUST = 2  # a guest's decode-steps must have matched the prediction this many times in a row


class Stepper:
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
                 "e_token", "e_pos", "moves")

    def __init__(self, passes: Passes, inst: Instance) -> None:
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
        # the instance's suspensions when the last step was queued: a prediction is made on physical
        # pages, stale once the instance was suspended (host/suspend.py) and resumed into others
        self.moves = inst.pages.moves

    def step(self, pages: list[int], last_len: int, token: int, position: int, sampler: Any) -> int:
        """forward.decode-step: claim the prediction if these are its arguments, else submit."""
        with self.passes.gate(self.inst):  # (waits while the instance is suspended)
            fut, trusted = self.begin(pages, last_len, token, position, sampler)
        # (terminated or out of budget: nothing more ahead)
        out: int | None = self.inst.wait_for(fut, lambda: setattr(fut, "follow", None))[0].token
        assert out is not None  # the spec asked for a sampled token
        return self.end(fut, trusted, out, pages, last_len, position)

    def begin(self, pages: list[int], last_len: int, token: int, position: int,
              sampler: Any) -> tuple[ForwardFuture, bool]:
        """The step's job (the claimed prediction or a new submit) and whether its prediction
        follows it; run in the instance's `Passes.gate`."""
        inst, passes = self.inst, self.passes
        key = tuple(sampler.__dict__.values())
        if inst.pages.moves != self.moves:  # suspended since: what was predicted is stale
            self.moves = inst.pages.moves
            self.drop()
        fut = self.pending
        if fut is not None:
            self.pending = None
            req = fut.request
            assert isinstance(req, ForwardRequest)
            # (the prediction continues the last step, on its pages: `e_pages`, the guest's ids)
            if (token == req.tokens[0] and position == req.positions[0] and last_len == req.last_page_len
                    and key == self.key and pages == self.e_pages):
                ctx, _phys = passes.check_pages(inst, pages, last_len, 1, step=True)  # as for any step
                passes.pm(inst).note_write(inst.pages, req, passes.page_size, context_len=ctx)
                self.trust += 1
            else:
                if not passes.scheduler(inst).withdraw(fut):  # if still queued; else its result is dropped
                    self.dropped = fut
                self.trust = 0
                fut = None
        elif (token == self.e_token and position == self.e_pos and key == self.key
              and self._expected(pages, last_len)):
            self.trust += 1
        else:
            self.trust = 0
        if fut is None:
            fut = passes.scheduler(inst).submit(
                passes.decode_request(inst, pages, last_len, token, position, sampler, key), inst.id)
        self.key = key
        trusted = self.trust >= TRUST and passes.lookahead
        if trusted:
            fut.follow = self.follow
        return fut, trusted

    def end(self, fut: ForwardFuture, trusted: bool, out: int, pages: list[int], last_len: int, position: int,
            wait: bool = True) -> int:
        """After the step's job drew `out`: what the next call is expected to be. A trusted step done
        before its follow-up was set queues the prediction here (not `wait`: only if the instance's
        gate is free now; else there is none)."""
        if trusted and fut.follow is not None:  # done before the follow-up was set: queue the prediction here
            fut.follow = None
            if wait:
                with self.passes.gate(self.inst):
                    self._queue(fut, out)
            elif (gate := self.passes.gate_now(self.inst)) is not None:
                try:
                    self._queue(fut, out)
                finally:
                    gate.__exit__(None, None, None)
        self.e_pages, self.e_token, self.e_pos = pages, out, position + 1
        self.e_len = last_len + 1 if last_len < self.passes.page_size else 0
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
                or passes.pm(self.inst).filled(self.inst.pages, req.pages[-1]) > req.last_page_len
                or self.inst.pages.moves != self.moves or self.inst.pages.state != "active"):
            # (filled: the guest wrote that slot before, and may still count on it; moves / state:
            # the instance is being suspended or was, the step's physical pages are not its own now)
            return False
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
                self.pending = self.passes.scheduler(self.inst).submit(req, fut.owner, lookahead=True)

    def drop(self) -> None:
        """Another forward or kv call (or the instance's end): forget the prediction (withdrawn if
        still queued; one already running is kept in `dropped` until it ends)."""
        if self.pending is None and self.e_pages is None:
            return
        with self.lock:
            fut, self.pending = self.pending, None
            self.e_pages = None
            self.trust = 0
        if fut is not None and not self.passes.scheduler(self.inst).withdraw(fut):
            self.dropped = fut  # the owner's later jobs run after it anyway (same owner, in order)

    def close(self) -> ForwardFuture | None:
        """The instance ends: no more predictions. Returns one still running (its pages stay pinned
        until it ends; the instance's end does not wait for it)."""
        with self.lock:
            self.closed = True
        self.drop()
        fut, self.dropped = self.dropped, None
        return fut if fut is not None and not fut.done() else None
