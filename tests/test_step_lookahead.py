"""Lookahead for guests that step every token themselves (host/api/lookahead.py's `Stepper`): the
host runs a stepping guest's predicted next `decode-step` before the guest asks, and the guest's
call claims it only if it is exactly the predicted one.

The backend here samples from the whole context (the sum of the tokens in the K/V slots up to the
output, mod the vocabulary), so a step computed on pages that changed since shows in the output;
the expected outputs are worked out here from that rule, not by the host.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
from fakes import FakeBackend
from helpers import Run, wait_for, wasm_bytes

from gpu_backend.standin import StandInStep
from gpu_backend.types import Feed, ForwardRequest, OutputResult
from host import Host, HostConfig

VOCAB = 256
pytestmark = pytest.mark.build


class ContextBackend(FakeBackend):
    """The stand-in, but the sampled token is sum(tokens in the slots up to the output) % vocab."""

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> StandInStep:
        step = super().start_forward(reqs, feed)  # writes every request's slots (the batch's pages do not overlap)
        out = step.outputs
        ps = self.info.page_size
        for r, res in zip(reqs, out, strict=True):
            ctx = r.context_len(ps)
            for i, o in enumerate(r.outputs):
                total = sum(self.slots[(r.pages[s // ps], s % ps)] for s in range(ctx + o.index + 1))
                res[i] = OutputResult(token=total % VOCAB if o.sample else None)
        return step


def reference(slots: list[int], steps: int) -> list[int]:
    """Tokens of `steps` greedy decode steps after `slots` (the last one pending) under the rule above."""
    slots, out = list(slots), []
    for _ in range(steps):
        out.append(sum(slots) % VOCAB)
        slots.append(out[-1])
    return out


def _host(lookahead: bool, delay_s: float) -> Host:
    return Host(HostConfig(step_lookahead=lookahead),
                backend=ContextBackend(page_size=4, num_pages=64, delay_s=delay_s))


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[bool, tuple[Host, str]]]:
    made = {la: _host(la, 0.002) for la in (True, False)}
    yield {la: (h, h.compile(wasm_bytes("misbehave"))) for la, h in made.items()}
    for h in made.values():
        h.shutdown()


def _run(host: Host, program: str, args: list[str]) -> tuple[str, dict[str, int]]:
    before = host.scheduler.stats.as_dict()
    end = Run(host, program, args).finish(60)
    assert end.event == "completed", end.message
    after = host.scheduler.stats.as_dict()
    return end.message, {k: after[k] - before[k] for k in ("forwards", "lookaheads", "lookaheads_withdrawn")}


PROMPT = [3, 1, 4, 1, 5]


def test_the_sdk_step_loop_runs_ahead_with_the_same_tokens(hosts: dict[bool, tuple[Host, str]]) -> None:
    """`Context.decode_step` x 24 (page size 4, pages crossed): same tokens with lookahead on and off,
    both the reference's. On, after two matched calls every step that stays in its page was run
    ahead and claimed: positions 7..27 but the 5 that open a page (the guest allocates those)."""
    want = " ".join(map(str, reference(PROMPT, 24)))
    got_on, on = _run(*hosts[True], ["generate", "24", *map(str, PROMPT)])
    got_off, off = _run(*hosts[False], ["generate", "24", *map(str, PROMPT)])
    assert got_on == want and got_off == want
    assert off == {"forwards": 25, "lookaheads": 0, "lookaheads_withdrawn": 0}
    assert on == {"forwards": 25, "lookaheads": 16, "lookaheads_withdrawn": 0}  # every one claimed


def test_a_call_between_two_steps_drops_the_prediction(hosts: dict[bool, tuple[Host, str]]) -> None:
    """After 3 steps the 4th is run ahead; the guest then rewrites position 1 with forward.run and
    makes exactly the predicted call: it must get a step computed on the rewritten pages."""
    first, rewritten = 7, 200
    out = reference([first], 3)
    want = out + [(first + rewritten + out[1] + out[2]) % VOCAB]
    assert want[-1] != reference([first], 4)[-1]  # the stale prediction's token would differ
    for lookahead, (host, program) in hosts.items():
        got, stats = _run(host, program, ["step_rewrite", str(first), str(rewritten)])
        assert got == " ".join(map(str, want)), f"lookahead={lookahead}"
        # the prediction was queued (then run and dropped, or withdrawn)
        assert stats["lookaheads"] == int(lookahead)
        assert stats["forwards"] + stats["lookaheads_withdrawn"] == 5 + int(lookahead)


def test_a_guest_stepping_over_positions_it_wrote_before_is_not_run_ahead_over_them(
        hosts: dict[bool, tuple[Host, str]]) -> None:
    """Positions 0..4 prefilled, then stepped again from 0: after the third step the next slot (3)
    still holds what the guest wrote there, which its next pass reads; no step is run ahead."""
    a, b, c, d, e, f = 5, 6, 7, 100, 9, 11
    out = reference([a], 3)
    want = out + [(a + out[0] + out[1] + d + e + f) % VOCAB]
    assert d != out[2]  # a step run ahead would have put out[2] where d is
    for lookahead, (host, program) in hosts.items():
        got, stats = _run(host, program, ["step_rewind", *map(str, (a, b, c, d, e, f))])
        assert got == " ".join(map(str, want)), f"lookahead={lookahead}"
        assert stats == {"forwards": 5, "lookaheads": 0, "lookaheads_withdrawn": 0}


def test_sequences_stepped_in_turn_are_not_run_ahead(hosts: dict[bool, tuple[Host, str]]) -> None:
    a, b = 9, 40
    ra, rb = reference([a], 4), reference([b], 4)
    want = " ".join(str(t) for pair in zip(ra, rb, strict=True) for t in pair)
    got, stats = _run(*hosts[True], ["step_alternate", str(a), str(b)])
    assert got == want
    assert stats == {"forwards": 8, "lookaheads": 0, "lookaheads_withdrawn": 0}


class _Timed(ContextBackend):
    """ContextBackend noting when each batch starts."""

    def __init__(self, **kw) -> None:  # noqa: ANN003
        super().__init__(**kw)
        self.starts: list[float] = []

    def start_forward(self, reqs: Sequence[ForwardRequest], feed: Feed | None = None) -> StandInStep:
        self.starts.append(time.monotonic())
        return super().start_forward(reqs, feed)


def test_an_instance_that_ends_with_a_step_run_ahead_reports_its_end_without_waiting_for_it() -> None:
    """22 steps end mid-page: the 23rd was predicted and is running (200 ms steps) when the guest
    returns. Its end is reported at once, not when that step has run (the guest never asked for
    it: an OpenAI handler stopping at max_tokens paid a step per request); the step's page is
    pinned until it has run, then every page is free."""
    backend = _Timed(page_size=4, num_pages=64, delay_s=0.2)
    host = Host(HostConfig(step_lookahead=True), backend=backend)
    try:
        program = host.compile(wasm_bytes("misbehave"))
        free0 = host.free_pages()
        before = host.scheduler.stats.as_dict()
        end = Run(host, program, ["generate", "22", *map(str, PROMPT)]).finish(60)
        ended = time.monotonic()
        assert end.event == "completed", end.message
        assert end.message == " ".join(map(str, reference(PROMPT, 22)))
        # the end came while the last batch (the unclaimed prediction) ran (the wait read >= 0.2 s)
        assert ended - backend.starts[-1] < 0.15, ended - backend.starts[-1]
        wait_for(lambda: host.free_pages() == free0, 5)
        after = host.scheduler.stats.as_dict()
        stats = {k: after[k] - before[k] for k in ("forwards", "lookaheads", "lookaheads_withdrawn")}
        assert stats["lookaheads"] == 15  # 7..26 but 8, 12, 16, 20, 24; the last (26) never claimed
        assert stats["forwards"] + stats["lookaheads_withdrawn"] == 1 + 22 + 1
    finally:
        host.shutdown()
