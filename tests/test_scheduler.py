"""Scheduler: batching policies, per-instance order, conflicts, backend failures."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gpu_backend.types import ForwardError, ForwardRequest, OutputResult
from host.batching.future import CopyRequest
from host.batching.policy import AdaptivePolicy, BatchPolicy, KOrTPolicy, make_policy
from host.batching.scheduler import ForwardFn, Scheduler


def req(pages: list[int], last: int, n: int, tag: int = 0) -> ForwardRequest:
    return ForwardRequest(pages=pages, last_page_len=last, tokens=[tag] * n, positions=list(range(n)))


def make(forward: ForwardFn, page_size: int = 4, policy: BatchPolicy | None = None,
         max_batch_tokens: int = 10240, copy=None) -> Scheduler:  # noqa: ANN001
    s = Scheduler(policy or AdaptivePolicy(), max_batch_tokens=max_batch_tokens)
    s.bind(forward, copy, page_size)
    return s


class Recorder:
    """A backend that records its batches; `hold()` makes the next batch block inside it."""

    def __init__(self, delay: float = 0.0) -> None:
        self.batches: list[list[int]] = []
        self.log: list[str] = []  # forwards and copies in the order they ran
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def hold(self, s: Scheduler) -> None:
        """Submit a forward and wait until it is blocked inside the backend."""
        self.gate.clear()
        self.entered.clear()
        s.submit(req([63], 1, 1, tag=99), "x")
        assert self.entered.wait(5)

    def __call__(self, reqs: list[ForwardRequest]) -> list[list[OutputResult]]:
        self.entered.set()
        self.gate.wait()
        time.sleep(self.delay)
        self.batches.append([r.tokens[0] for r in reqs])
        self.log.append(f"forward {[r.tokens[0] for r in reqs]}")
        return [[OutputResult(token=r.tokens[0])] for r in reqs]

    def copy(self, src: int, src_off: int, dst: int, dst_off: int, count: int) -> None:
        self.log.append(f"copy {src}->{dst}")


def test_adaptive_fires_everything_queued_while_busy() -> None:
    rec = Recorder()
    s = make(rec)
    rec.gate.clear()
    first = s.submit(req([0], 1, 1, tag=0), "a")
    assert rec.entered.wait(5)  # the first batch is now blocked inside the backend
    rest = [s.submit(req([i], 1, 1, tag=i), f"i{i}") for i in range(1, 9)]
    rec.gate.set()
    assert first.wait(5)[0].token == 0
    assert [f.wait(5)[0].token for f in rest] == list(range(1, 9))
    assert rec.batches == [[0], list(range(1, 9))]
    st = s.stats.as_dict()
    assert st["batches"] == 2 and st["forwards"] == 9 and st["mean_batch_size"] == 4.5
    s.stop()


def test_dependent_forwards_of_one_instance_keep_order() -> None:
    rec = Recorder()
    s = make(rec)
    rec.hold(s)
    # instance a: prefill into page 0, then a decode into the same page (depends on it)
    a1 = s.submit(req([0], 3, 3, tag=1), "a")
    a2 = s.submit(req([0], 4, 1, tag=2), "a")
    b1 = s.submit(req([5], 1, 1, tag=3), "b")
    rec.gate.set()
    for f in (a1, a2, b1):
        f.wait(5)
    assert rec.batches[1] == [1, 3]  # a2 conflicts with a1 (same page written): next batch
    assert rec.batches[2] == [2]
    s.stop()


def test_independent_forwards_of_one_instance_batch_together() -> None:
    """Beams: forwards over a shared read-only prefix page, each writing its own page."""
    rec = Recorder()
    s = make(rec)
    rec.hold(s)
    futs = [s.submit(req([0, 1 + i], 1, 1, tag=i), "beam") for i in range(4)]
    rec.gate.set()
    for f in futs:
        f.wait(5)
    assert rec.batches[1] == [0, 1, 2, 3]
    s.stop()


def test_max_batch_tokens_caps_a_batch() -> None:
    rec = Recorder()
    s = make(rec, page_size=16, max_batch_tokens=10)
    rec.hold(s)
    futs = [s.submit(req([i], 6, 6, tag=i), f"i{i}") for i in range(3)]
    rec.gate.set()
    for f in futs:
        f.wait(5)
    assert rec.batches[1:] == [[0], [1], [2]]
    s.stop()


def test_k_or_t_waits_for_k_or_timeout() -> None:
    rec = Recorder()
    s = make(rec, policy=KOrTPolicy(k=3, t_ms=200))
    t0 = time.perf_counter()
    f = s.submit(req([0], 1, 1, tag=0), "a")
    f.wait(5)
    assert time.perf_counter() - t0 >= 0.19  # alone: fired by the timeout
    futs = [s.submit(req([i], 1, 1, tag=i), f"i{i}") for i in range(3)]
    t1 = time.perf_counter()
    for g in futs:
        g.wait(5)
    assert time.perf_counter() - t1 < 0.15  # k reached: fired at once
    assert rec.batches[-1] == [0, 1, 2]
    s.stop()


def test_backend_failure_fails_that_batch_only() -> None:
    calls = {"n": 0}

    def flaky(reqs: list[ForwardRequest]) -> list[list[OutputResult]]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("CUDA fell over")
        return [[OutputResult(token=7)] for _ in reqs]

    s = make(flaky)
    bad = s.submit(req([0], 1, 1), "a")
    with pytest.raises(RuntimeError, match="CUDA fell over"):
        bad.wait(5)
    assert s.submit(req([1], 1, 1), "b").wait(5)[0].token == 7
    assert s.stats.errors == 1
    s.stop()


def test_adaptive_waits_for_the_last_batch_to_resubmit() -> None:
    """Instances of a finished batch that come back a few ms apart still share the next batch."""
    rec = Recorder(delay=0.04)
    s = make(rec)
    owners = [f"i{i}" for i in range(4)]
    rec.gate.clear()
    firsts = [s.submit(req([i], 1, 1, tag=i), o) for i, o in enumerate(owners)]
    rec.gate.set()
    for f in firsts:
        f.wait(5)
    seconds = []
    for i, o in enumerate(owners):  # staggered like guests doing work between steps
        time.sleep(0.003)
        seconds.append(s.submit(req([i], 2, 1, tag=10 + i), o))
    for f in seconds:
        f.wait(5)
    assert rec.batches[-1] == [10, 11, 12, 13]
    s.forget("i0")  # an ended instance is not waited for
    s.stop()


def test_call_runs_on_the_scheduler_thread_and_propagates_errors() -> None:
    s = Scheduler()
    with pytest.raises(RuntimeError, match="no backend yet"):
        s.submit(req([0], 1, 1), "a")
    assert s.call(lambda: threading.current_thread().name) == "pie-scheduler"

    def boom() -> None:
        raise FileNotFoundError("no such model")

    with pytest.raises(FileNotFoundError, match="no such model"):
        s.call(boom)
    s.bind(Recorder(), None, 4)
    assert s.submit(req([0], 1, 1, tag=3), "a").wait(5)[0].token == 3
    s.stop()


def test_adaptive_waits_for_launched_instances_so_their_prefills_batch_together() -> None:
    """Requests launched together prefill in one batch, not the first alone and the rest after."""
    rec = Recorder()
    s = make(rec, policy=AdaptivePolicy(launch_grace_s=2.0))
    owners = [f"i{i}" for i in range(4)]
    for o in owners:
        s.expect(o)
    futs = []
    for i, o in enumerate(owners):  # instances start up a few ms apart
        futs.append(s.submit(req([i], 1, 1, tag=i), o))
        time.sleep(0.01)
    for f in futs:
        f.wait(5)
    assert rec.batches == [[0, 1, 2, 3]]
    s.stop()



def test_by_default_a_launch_waits_for_another_only_briefly() -> None:
    """With the default policy, an instance launched at an idle host does not wait for another
    launched with it that takes long to start (it joins the batches as they come: waiting for a
    whole burst made all of it end after the same last step)."""
    rec = Recorder()
    s = make(rec, policy=AdaptivePolicy())
    s.expect("quick")
    s.expect("slow")  # launched too, submits only after 0.5 s
    t0 = time.perf_counter()
    s.submit(req([0], 1, 1, tag=0), "quick").wait(5)
    assert time.perf_counter() - t0 < 0.04
    s.submit(req([1], 1, 1, tag=1), "slow").wait(5)
    assert rec.batches == [[0], [1]]
    s.stop()

def test_adaptive_stops_waiting_for_an_instance_that_blocks_or_never_submits() -> None:
    rec = Recorder()
    s = make(rec, policy=AdaptivePolicy(launch_grace_s=0.3))
    s.expect("waits-for-input")
    s.expect("silent")
    t0 = time.perf_counter()
    f = s.submit(req([0], 1, 1, tag=0), "a")
    s.forget("waits-for-input")  # what an instance does when it blocks on something else
    f.wait(5)
    waited = time.perf_counter() - t0
    assert 0.25 <= waited < 2.0  # held back only by "silent", until its launch grace ran out
    s.stop()


def test_a_rejected_request_fails_alone_and_the_rest_of_its_batch_runs() -> None:
    rec = Recorder()

    def strict(reqs: list[ForwardRequest]) -> list[list[OutputResult]]:
        for i, r in enumerate(reqs):
            if r.tokens[0] == 13:
                raise ForwardError(i, f"forward request {r.name!r}: token 13 is unlucky")
        return rec(reqs)

    s = make(strict)
    rec.gate.clear()
    s.submit(req([63], 1, 1, tag=99), "x")
    assert rec.entered.wait(5)
    futs = [s.submit(req([i], 1, 1, tag=10 + i), f"i{i}") for i in range(6)]
    rec.gate.set()
    assert [f.wait(5)[0].token for f in futs if f.request.tokens[0] != 13] == [10, 11, 12, 14, 15]
    with pytest.raises(ForwardError, match="unlucky"):
        futs[3].wait(5)
    assert rec.batches[-1] == [10, 11, 12, 14, 15]  # one backend call for the rest
    assert s.stats.errors == 1
    s.stop()


def test_copy_runs_after_the_same_owners_earlier_forwards() -> None:
    rec = Recorder()
    s = make(rec, copy=rec.copy)
    rec.hold(s)
    f1 = s.submit(req([0], 1, 1, tag=1), "a")  # writes page 0
    c = s.submit(CopyRequest(0, 0, 1, 0, 1, "a"), "a")  # reads page 0: must wait for f1
    f2 = s.submit(req([1], 2, 1, tag=2), "a")  # after the copy, into its destination
    other = s.submit(req([5], 1, 1, tag=3), "b")
    rec.gate.set()
    for f in (f1, c, f2, other):
        f.wait(5)
    assert rec.log == ["forward [99]", "forward [1, 3]", "copy 0->1", "forward [2]"]
    assert s.stats.copies == 1
    s.stop()


def test_a_copy_does_not_wait_for_the_batching_policy() -> None:
    rec = Recorder()
    s = make(rec, policy=AdaptivePolicy(launch_grace_s=30.0), copy=rec.copy)
    s.expect("slow")  # adaptive now holds forwards back for up to 30 s
    held = s.submit(req([0], 1, 1, tag=1), "b")
    c = s.submit(CopyRequest(2, 0, 3, 0, 4, "a"), "a")
    c.wait(5)
    assert rec.log == ["copy 2->3"] and not held.done()
    s.forget("slow")
    assert held.wait(5)[0].token == 1
    s.stop()


def test_policies_are_classes_behind_one_interface() -> None:
    assert isinstance(make_policy("adaptive"), AdaptivePolicy)
    p = make_policy("k-or-t", k=2, t_ms=1000)
    assert isinstance(p, KOrTPolicy) and isinstance(p, BatchPolicy)
    q = [type("F", (), {"submitted": time.perf_counter()})()]
    assert not p.ready(q, time.perf_counter())  # type: ignore[arg-type]
    assert p.ready(q * 2, time.perf_counter())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown batching policy 'fifo'"):
        make_policy("fifo")


def test_a_submit_wakes_the_scheduler_only_when_it_can_fire() -> None:
    rec = Recorder()
    s = make(rec)
    wakes = [0]
    notify = s._cv.notify

    def counting_notify(n: int = 1) -> None:
        wakes[0] += 1
        notify(n)

    s._cv.notify = counting_notify  # type: ignore[method-assign]
    for owner in ("a", "b", "c"):
        s.expect(owner)  # three launched instances: the policy waits for all of them
    futs = [s.submit(req([i], 1, 1, tag=i), owner) for i, owner in enumerate(("a", "b", "c"))]
    for f in futs:
        f.wait(5)
    assert rec.batches == [[0, 1, 2]]  # one batch, fired when the last expected one arrived
    # the first submit (the scheduler had nothing to do) and the last (the batch is complete)
    assert wakes[0] == 2
    s.stop()


class _Loop:
    """A stand-in host-side generation loop: ends after `steps` steps."""

    def __init__(self, request: ForwardRequest, steps: int) -> None:
        self.request, self.left, self.result, self.cancelled = request, steps, None, False
        self.fast = 0  # every step through advance
        self.ahead = False  # one step at a time (not prepared while the last one runs)

    def advance(self, token: int) -> bool:
        self.left -= 1
        if self.left == 0:
            self.result = f"ended after {token}"
        return self.left == 0

    def note_writes(self) -> None:  # the scheduler's call when a loop ends (nothing noted here)
        pass


class _Spy(AdaptivePolicy):
    def __init__(self) -> None:
        super().__init__()
        self.waited_for: list[list[str]] = []

    def batch_done(self, owners, start: float, end: float) -> None:  # noqa: ANN001
        self.waited_for.append(sorted(owners))
        super().batch_done(owners, start, end)


def test_an_ended_loop_holds_no_batch_while_other_loops_go_on() -> None:
    """The owner of a loop that ended may come back or end; while other loops run, the next batch
    does not wait for it (in a burst's tail that wait cost every running loop ~5 ms per step)."""
    rec = Recorder()
    spy = _Spy()
    s = make(rec, policy=spy)
    rec.hold(s)
    short = s.submit(req([0], 1, 1, tag=1), "short", generation=_Loop(req([0], 1, 1, tag=1), 1))  # type: ignore[arg-type]
    long = s.submit(req([1], 1, 1, tag=2), "long", generation=_Loop(req([1], 1, 1, tag=2), 3))  # type: ignore[arg-type]
    rec.gate.set()
    assert short.wait(5) == "ended after 1"
    assert long.wait(5) == "ended after 2"
    assert rec.batches == [[99], [1, 2], [2], [2]]
    # after [1, 2] "long" went on: nobody waited for; after its last step nothing runs: waited for
    assert spy.waited_for == [["x"], ["long"]]
    s.stop()


def test_the_policy_hears_whom_to_wait_for_before_anyone_wakes() -> None:
    """A guest woken by its result may resubmit at once; had the policy not yet been told to wait
    for it, it would wait for it again, in vain, until its grace ran out."""
    log: list[tuple[str, str]] = []

    class Spy(AdaptivePolicy):
        def batch_done(self, owners, start: float, end: float) -> None:  # noqa: ANN001
            log.extend(("expect", o) for o in owners)
            super().batch_done(owners, start, end)

    rec = Recorder()
    s = make(rec, policy=Spy())
    rec.hold(s)
    fut = s.submit(req([1], 1, 1, tag=1), "a")
    fut.add_done_callback(lambda _f: log.append(("wake", "a")))
    rec.gate.set()
    fut.wait(5)
    assert log.index(("expect", "a")) < log.index(("wake", "a"))
    s.forget("a")
    s.stop()


def test_a_launch_holds_no_batch_while_work_is_under_way() -> None:
    """At an idle scheduler a launched instance is waited for (a burst prefills together); while a
    batch runs or forwards are queued, it joins the next batch instead of holding the running ones."""
    rec = Recorder()
    s = make(rec)
    s.expect("early")
    assert s.policy.expects("early")
    s.forget("early")
    rec.hold(s)  # a batch is in the backend
    s.expect("late")
    assert not s.policy.expects("late")
    rec.gate.set()
    s.submit(req([1], 1, 1, tag=1), "y").wait(5)
    s.forget("x")
    s.forget("y")
    s.stop()


class _Pins:
    """Counts pins per page, as the page manager does."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.forgotten: list[int] = []

    def pin(self, pages) -> None:  # noqa: ANN001
        for p in pages:
            self.count[p] = self.count.get(p, 0) + 1

    def unpin(self, pages) -> None:  # noqa: ANN001
        for p in pages:
            self.count[p] -= 1

    def forget_content(self, pages) -> None:  # noqa: ANN001
        self.forgotten.extend(pages)


def test_a_follow_up_is_queued_before_its_owner_wakes_and_keeps_the_pages_pinned() -> None:
    """`ForwardFuture.follow` (a stepping guest's predicted next step): the scheduler thread queues
    what it returns before the done step's waiter wakes, so the next batch has it without a submit;
    the follow-up takes over the step's pins, and they go when it ends."""
    from host.batching.future import ForwardFuture

    rec = Recorder()
    pins = _Pins()
    s = Scheduler(AdaptivePolicy())
    s.bind(rec, None, 4, pins=pins)
    seen: list[tuple[int, int]] = []  # (page 7's pins, queued jobs) when the first step's waiter wakes
    follow_ups: list[ForwardFuture] = []

    def follow(fut: ForwardFuture, outputs: list[OutputResult]) -> ForwardFuture:
        nxt = ForwardFuture(req([7], 2, 1, tag=(outputs[0].token or 0) + 1), fut.owner)
        follow_ups.append(nxt)
        return nxt

    rec.hold(s)
    first = s.submit(req([7], 1, 1, tag=1), "a")
    first.follow = follow
    first.add_done_callback(lambda _f: seen.append((pins.count[7], len(s._queue))))
    rec.gate.set()
    assert first.wait(5)[0].token == 1
    assert follow_ups and follow_ups[0].wait(5)[0].token == 2  # ran without anyone submitting it
    assert seen == [(1, 1)]  # queued, pages still pinned, before the waiter woke
    assert rec.batches[-2:] == [[1], [2]] and first.follow is None  # called once, then cleared
    assert pins.count[7] == 0 and s.stats.lookaheads == 1
    s.stop()


def test_withdraw_takes_back_a_queued_job_only() -> None:
    rec = Recorder()
    pins = _Pins()
    s = Scheduler(AdaptivePolicy())
    s.bind(rec, None, 4, pins=pins)
    rec.hold(s)  # a batch is in the backend: what is submitted now stays queued
    later = s.submit(req([63], 1, 1, tag=98), "x")  # queued behind the held one (same owner)
    queued = s.submit(req([5], 2, 1, tag=5), "a")
    assert pins.count[5] == 1
    assert s.withdraw(queued)
    assert pins.count[5] == 0 and pins.forgotten == []  # it wrote nothing: the page's content stays known
    with pytest.raises(RuntimeError, match="withdrawn"):
        queued.wait(1)
    rec.gate.set()
    later.wait(5)
    assert not s.withdraw(later)  # done: nothing to take back
    assert all(5 not in b for b in rec.batches)
    assert s.stats.lookaheads_withdrawn == 1
    s.stop()


def test_a_loop_that_ends_mid_page_has_its_last_writes_noted() -> None:
    """A host-side loop notes its writes a page at a time; when it ends, the scheduler has it note
    the rest, so the last, partial page's write mark (what step lookahead reads) is exact."""
    from gpu_backend.types import OutputSpec, SamplerParams
    from host.batching.generation import Generation, StopRules
    from host.state.pages import InstancePages, PageManager
    from host.state.prefix_cache import PrefixCache

    pm = PageManager(16, cache=PrefixCache(4, "per-client"))
    table = InstancePages("a")
    pages = pm.allocate(table, 1)
    assert isinstance(pages, list)
    first = ForwardRequest(pages=list(pages), last_page_len=2, tokens=[7, 8], positions=[0, 1],
                           outputs=[OutputSpec(index=1, sample=SamplerParams())])
    pm.note_write(table, first, 4)
    gen = Generation(first, SamplerParams(), StopRules(5, frozenset(), (), 1000), 4, pm, table,
                     lambda ids: "", None)
    s = Scheduler(AdaptivePolicy())
    s.bind(Recorder(), None, 4, pins=pm)
    try:
        result = s.submit(first, "a", generation=gen).wait()
    finally:
        s.stop()
    # 2 prompt tokens + 4 of the 5 drawn ones written (the last drawn is not): slots 0-5
    assert [pm.filled(table, p) for p in pages + result.new_pages] == [4, 2]


def test_a_loops_steps_are_the_same_on_the_fast_path() -> None:
    """Most steps of a host-side loop are done inline by the scheduler (`Generation.fast`); each
    step's pass must still be what the loop's rules make of the drawn token: the token, the next
    position, the page geometry (a new page when one fills), and the loop ends at a stop token drawn
    mid-page. Expected passes are computed here from the geometry, not by the code under test."""
    from gpu_backend.types import OutputSpec, SamplerParams
    from host.batching.generation import Generation, StopRules
    from host.state.pages import InstancePages, PageManager

    drawn = [40 + i for i in range(13)] + [3]  # the 14th draw is a stop token, in the middle of page 4
    seen: list[tuple[list[int], list[int], int, int]] = []

    def backend(reqs: list[ForwardRequest]) -> list[list[OutputResult]]:
        (r,) = reqs
        seen.append((list(r.tokens), list(r.positions), len(r.pages), r.last_page_len))
        return [[OutputResult(token=drawn[len(seen) - 1])]]

    pm = PageManager(16)
    table = InstancePages("a")
    pages = pm.allocate(table, 1)
    assert isinstance(pages, list)
    prompt = [7, 8, 9]
    first = ForwardRequest(pages=list(pages), last_page_len=3, tokens=list(prompt), positions=[0, 1, 2],
                           outputs=[OutputSpec(index=2, sample=SamplerParams())])
    gen = Generation(first, SamplerParams(), StopRules(100, frozenset({3}), (), 1000), 4, pm, table,
                     lambda ids: "", None)
    advanced = 0

    def counted(method: Any) -> Any:
        def call(token: int) -> bool:
            nonlocal advanced
            advanced += 1
            return method(token)
        return call

    gen.advance = counted(gen.advance)  # type: ignore[method-assign]
    gen.took = counted(gen.took)  # type: ignore[method-assign]
    s = Scheduler(AdaptivePolicy())
    s.bind(backend, None, 4, pins=pm)
    try:
        result = s.submit(first, "a", generation=gen).wait(5)
    finally:
        s.stop()
    assert (result.tokens, result.finish, result.trim) == (drawn, "stop-token", 1)
    assert seen[0] == (prompt, [0, 1, 2], 1, 3)
    for k in range(1, len(drawn)):  # step k writes drawn token k-1 at slot / position 2 + k
        slot = 2 + k
        assert seen[k] == ([drawn[k - 1]], [slot], slot // 4 + 1, slot % 4 + 1), k
    assert len(result.new_pages) == 3 and len(set(result.new_pages + pages)) == 4
    # through `took` / `advance` (the slow path; the rest inline, `Generation.fast_step`): each step
    # that fills a page (it notes the page's writes and prepares the step that takes a new page:
    # the steps writing draws 1, 5, 9 and 13 at slots 3, 7, 11, 15) and the stop token (`advance`)
    assert advanced == 5 < len(drawn), advanced
