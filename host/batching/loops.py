"""The host-side generation loops' steps between batches (the scheduler's `Loops`).

A loop (`forward.generate`) is in every batch until it ends. With the batch launched, each loop
that runs ahead takes the token its launched step writes and prepares its next step (`after_launch`:
a fast step inline, `Generation.fast_step`; else `Generation.took` / `prepare`); once the batch
has run, the drawn tokens are written into the prepared steps (`fill_ahead`), which go first into
the next batch; loops whose token is a stop token, whose step was their last or that were
cancelled end after the next launch (`end_finals`). Loops that cannot run ahead (a grammar's mask
needs the token) take their step once the batch has run (`step_loops`, `step`). Runs on the
scheduler thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from gpu_backend.types import ForwardRequest, OutputResult
from host.batching.future import ForwardFuture
from host.batching.generation import Generation

__all__ = ["Loops"]

log = logging.getLogger("host.batching.scheduler")


class Loops:
    """The running loops: `resident` (stepped once their batch has run), `ahead` (next step ready,
    token written in; `ahead_reqs` their requests: the next launch's first), and the work the last
    batch left for after the next launch: steps to prepare (`fill`, with their rows), loops whose
    row was their last (`lasts`), those left out to end (`finals`: future, token, prepared)."""

    def __init__(self, complete: Callable[[ForwardFuture, Any, BaseException | None], None],
                 expect: Callable[[list[str], float, float], None]) -> None:
        self._complete, self._expect = complete, expect
        self.resident: list[ForwardFuture] = []
        self.ahead: list[ForwardFuture] = []
        self.ahead_reqs: list[ForwardRequest] = []
        self.fill: list[tuple[ForwardFuture, frozenset[int], ForwardRequest, list[int], int]] = []
        self.lasts: list[tuple[ForwardFuture, int]] = []
        self.broken: list[ForwardFuture] = []
        self.finals: list[tuple[ForwardFuture, int | None, bool]] = []
        self.last_batch = (0.0, 0.0)  # the last batch's start and end
        # Fed: `ahead` launched before the batch drawing their tokens has been waited for (`feed`):
        # each one's row in that batch, and the loops whose fed step turned out to be wasted
        # (their token is a stop token: they end once the batch holding that step has run).
        self.ahead_rows: list[int] = []
        self.wasted: dict[int, tuple[ForwardFuture, int | None]] = {}

    def after_launch(self, batch: list[ForwardFuture], ahead: int, loops: int) -> None:
        """While `batch` runs: end the loops left out of it, and for each loop in it that runs ahead,
        take the token its step writes and prepare its next step (`fill`, with its row), or note
        that this step is its last (`lasts`). A common step is done inline (`Generation.fast`)."""
        self.end_finals(hold=loops == 0)
        fill, wasted = self.fill, self.wasted
        for i in range(ahead):
            f = batch[i]
            gen = f.generation
            assert gen is not None  # batch[:ahead] are loops
            if wasted and id(f) in wasted:  # fed a stop token: it ends once this batch has run
                continue
            req = gen.request
            if gen.fast > 0 and not gen.cancelled:
                gen.fast_step(req.tokens[0])
                fill.append((f, gen.stop_tokens, req, req.tokens, i))
                continue
            self.prepare(f, gen, i, req.tokens[0])
        for i in range(loops, len(batch)):  # first steps of loops that run ahead
            f = batch[i]
            gen = f.generation
            if gen is not None and gen.ahead:
                self.prepare(f, gen, i, None)

    def prepare(self, fut: ForwardFuture, gen: Generation, row: int, token: int | None) -> None:
        if gen.cancelled:  # the step just launched is its last
            self.lasts.append((fut, row))
            return
        try:
            prepared = gen.prepare() if token is None else gen.took(token)
        except Exception:  # a host bug: the loop ends with an error once its step has run
            log.exception("generation loop of %s failed", fut.owner)
            self.broken.append(fut)
            return
        if prepared:
            self.fill.append((fut, gen.stop_tokens, gen.request, gen.request.tokens, row))
        else:
            self.lasts.append((fut, row))

    def feed(self) -> None:
        """The prepared steps go into the next batch before this one's tokens are read (`fed`: the
        backend writes each one's token from its row of the batch still running); `fill` stays,
        for `fill_ahead` to check those tokens once that batch has run."""
        self.ahead = [e[0] for e in self.fill]
        self.ahead_reqs = [e[2] for e in self.fill]
        self.ahead_rows = [e[4] for e in self.fill]

    def unfeed(self) -> None:
        """The fed steps were not launched: `fill_ahead` writes their tokens in instead."""
        self.ahead, self.ahead_reqs, self.ahead_rows = [], [], []

    def fill_ahead(self, results: list[list[OutputResult]], drawn: list[int | None] | None, fed: bool) -> None:
        """The batch's drawn tokens (`drawn`: the backend's flat list of each request's first output's
        token, if it gives one: a few cache lines instead of two objects per row; else read from
        `results`) into the prepared steps: those loops go first into the next batch;
        a loop whose token is a stop token or whose step was its last (or that was cancelled before
        the launch) ends after the next launch (`finals`). `fed`: the prepared steps have been
        launched already (`feed`); one whose token is a stop token is wasted: that loop ends
        after the batch holding it has run (the next call)."""
        ahead, reqs, finals = self.ahead, self.ahead_reqs, self.finals
        if self.wasted:  # their wasted step was in the batch that has just run
            finals.extend((f, token, True) for f, token in self.wasted.values())
            self.wasted = {}
        if drawn is None or len(drawn) != len(results):
            drawn = [r[0].token if r else None for r in results]
        for f, stop_tokens, req, tokens, i in self.fill:
            token = drawn[i]
            if fed and f.done():  # its fed step failed at the launch: ended already
                continue
            if token is None or token in stop_tokens:
                if fed:
                    self.wasted[id(f)] = (f, token)
                else:
                    finals.append((f, token, True))
                continue
            tokens[0] = token
            if not fed:
                ahead.append(f)
                reqs.append(req)
        for f, i in self.lasts:
            finals.append((f, drawn[i], False))
        self.fill.clear()
        self.lasts.clear()

    def end_finals(self, hold: bool) -> None:
        """End the loops left out of the next batch (`Generation.finish`; one may go on, a step at a
        time). `hold`: no loop goes on, so the policy may wait for their owners (see `Scheduler._run`)."""
        finals, self.finals = self.finals, []
        if not finals:
            return
        ended: list[str] = []
        now = time.perf_counter()
        for f, token, prepared in finals:
            gen = f.generation
            assert gen is not None
            if f.done():  # a fed step of it failed at a launch: ended already
                continue
            try:
                done = gen.finish(token, prepared)
            except Exception as e:  # a host bug (or the backend drew no token) ends this loop only
                log.exception("generation loop of %s failed", f.owner)
                self._complete(f, None, RuntimeError(f"host error in generate: {type(e).__name__}: {e}"))
                ended.append(f.owner)
                continue
            if done:
                self._complete(f, gen.result, None)
                ended.append(f.owner)
            else:
                f.submitted = now
                self.resident.append(f)
        if hold and ended and not self.resident and not self.ahead:
            self._expect(ended, *self.last_batch)

    def step_loops(self, batch: list[ForwardFuture], results: list[list[OutputResult]], loops: int, end: float,
                    ended: list[str], first: int = 0) -> None:
        """The steps of the first `loops` forwards of `batch`, resident loops': a fast step inline
        (`Generation.fast`: its token is no stop token, so the loop goes on with the token written
        into its request), any other through `step`. With 256 loops this runs 256 times between two
        backend calls: a call per loop and the rules checked one by one cost 0.33 ms a step at 256
        (measured in a live burst), this 0.19 ms (mostly cache misses over the loops' objects)."""
        keep = self.resident  # (empty: the scheduler took the loops; `step` appends the others in order)
        for i in range(first, loops):
            f = batch[i]
            gen = f.generation
            assert gen is not None  # only loops are resident
            if gen.fast > 0 and not gen.cancelled:
                try:
                    token = results[i][0].token  # a loop's pass samples its one output
                except IndexError:  # a backend bug: `step` ends this loop with an error
                    token = None
                if token is not None and token not in gen.stop_tokens:
                    gen.fast_step(token)
                    f.submitted = end
                    keep.append(f)
                    continue
            if self.step(f, gen, results[i], end):
                ended.append(f.owner)

    def step(self, fut: ForwardFuture, gen: Generation, outputs: list[OutputResult], end: float) -> bool:
        """One step of a host-side loop is done: it stays for the next batch (False) or ends (True)."""
        try:
            token = outputs[0].token
            assert token is not None  # a generation's pass samples its one output
            ended = gen.advance(token)
        except Exception as e:  # a host bug ends this loop only
            log.exception("generation loop of %s failed", fut.owner)
            self._complete(fut, None, RuntimeError(f"host error in generate: {type(e).__name__}: {e}"))
            return True
        if ended:
            self._complete(fut, gen.result, None)
            return True
        fut.submitted = end  # its next step is queued from now (the scheduler's queue-wait stat)
        self.resident.append(fut)
        return False
