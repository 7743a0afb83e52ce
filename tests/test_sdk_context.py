"""Context page accounting, fork sharing, masks, export/import, async: the SDK on a fake host."""

from __future__ import annotations

import time

import pytest
from inferlet import PAGES, Context, OutOfPages, wait_any
from inferlet.testing import FakeHost, FakeTrap

PS = 4


@pytest.fixture
def host() -> FakeHost:
    return FakeHost(page_size=PS, num_pages=64).install()


def check_invariants(ctx: Context) -> None:
    assert len(ctx.pages) == -(-ctx.kv_len // PS)
    assert len(ctx.tokens) == len(ctx.positions) == len(ctx.masked)
    assert ctx.kv_len <= len(ctx.tokens)


def test_flush_keeps_last_token_pending_and_pages_fit(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("hello world")  # 11 byte tokens
    ctx.flush()
    assert ctx.kv_len == 10 and len(ctx.tokens) == 11
    req = host.forward.requests[-1]
    assert (req.last_page_len, len(req.pages), req.tokens) == (2, 3, ctx.tokens[:10])
    assert req.positions == list(range(10)) and req.mask == [] and req.outputs == []
    check_invariants(ctx)


def test_decode_is_one_forward_per_step_and_release_returns_pages(host: FakeHost) -> None:
    free0 = host.kv.free_pages()
    ctx = Context()
    ctx.fill("abcdefg")
    ctx.flush()
    n0 = len(host.forward.requests)
    text = ctx.generate(max_tokens=9)
    assert len(text) == 9 and len(host.forward.requests) - n0 == 9
    check_invariants(ctx)
    assert ctx.kv_len == 6 + 9 and len(ctx.tokens) == 16  # the 9th generated token is pending
    assert host.kv.allocations <= len(ctx.pages)
    last = host.forward.requests[-1]
    assert last.positions == [14] and last.last_page_len == 15 - 3 * PS
    ctx.release()
    assert host.kv.free_pages() == free0 and not host.kv.held and not PAGES.refs
    with pytest.raises(RuntimeError, match="released"):
        ctx.decode_step()


def test_stop_token_ends_generation_and_is_not_in_text(host: FakeHost) -> None:
    host.forward.script = [ord("o") + 3, ord("k") + 3, 2, ord("x") + 3]
    with Context() as ctx:
        ctx.fill("q")
        assert ctx.generate() == "ok"
        assert ctx.tokens[-1] == 2 and ctx.kv_len == len(ctx.tokens) - 1


def test_fork_shares_full_pages_and_copies_partial(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("0123456789")
    ctx.flush()  # kv_len 9: 2 full pages + 1 slot
    child = ctx.fork()
    assert child.pages[:2] == ctx.pages[:2] and child.pages[2] != ctx.pages[2]
    assert all(PAGES.refs[p] == 2 for p in ctx.pages[:2]) and PAGES.refs[child.pages[2]] == 1
    assert host.kv.slots[child.pages[2]][:1] == host.kv.slots[ctx.pages[2]][:1]
    check_invariants(child)
    # Same KV and state: both continue identically (the fake model reads every visible slot).
    assert ctx.generate(max_tokens=6) == child.generate(max_tokens=6)
    ctx.release()
    assert set(child.pages) <= host.kv.held  # shared pages survive the parent
    child.release()
    assert not host.kv.held


def test_fork_on_page_boundary_allocates_nothing(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("012345678")
    ctx.flush()  # kv_len 8: exactly two pages
    before = host.kv.allocations
    child = ctx.fork()
    assert child.pages == ctx.pages and host.kv.allocations == before
    child.decode_step()
    ctx.decode_step()
    assert child.pages[-1] != ctx.pages[-1]  # each writes into its own new page
    assert child.pages[:2] == ctx.pages[:2]


def test_masked_tokens_are_hidden_via_brle(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("abcdefghij")
    ctx.flush()
    ctx.mask_token_range(2, 6)
    ctx.decode_step()
    req = host.forward.requests[-1]
    assert req.mask == [[2, 4, 4]]  # attend a b, hide c..f, attend g h i + the pending j
    ctx.mask_token_range(3, 4, masked=False)
    ctx.decode_step()
    assert host.forward.requests[-1].mask == [[2, 1, 1, 2, 5]]


def test_masked_output_differs_from_unmasked(host: FakeHost) -> None:
    a, b = Context(), Context()
    for c in (a, b):
        c.fill("abcdefghij")
        c.flush()
    b.mask_token_range(0, 5)
    assert a.decode_step() != b.decode_step()


def test_drop_masked_pages_releases_full_masked_pages(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("abcdefghijklmn")  # 14 tokens
    ctx.flush()  # kv_len 13: pages 0-2 full, page 3 holds 1
    ctx.mask_token_range(0, 9)  # pages 0 and 1 fully masked, page 2 partly
    dropped_pages = ctx.pages[:2]
    assert ctx.drop_masked_pages() == 2
    assert not set(dropped_pages) & host.kv.held
    assert ctx.kv_len == 5 and len(ctx.tokens) == 6 and ctx.positions[0] == 8
    check_invariants(ctx)
    ctx.decode_step()  # the fake host validates mask shape and page lengths
    req = host.forward.requests[-1]
    assert req.positions == [13] and req.mask == [[0, 1, 5]] and req.last_page_len == 2
    assert ctx.drop_masked_pages() == 0


def test_export_import_continues_the_same_sequence(host: FakeHost) -> None:
    ctx, reference = Context(), Context()
    for c in (ctx, reference):
        c.fill("shared prefix!")
        c.flush()
    ctx.export("prefix")
    ctx.release()
    imp = Context.import_("prefix")
    assert imp.kv_len == 13 and len(imp.pages) == 4
    assert set(imp.pages[:-1]) <= host.kv.imported  # full pages read-only, the partial one own
    assert imp.pages[-1] in host.kv.owned
    assert imp.generate(max_tokens=5) == reference.generate(max_tokens=5)
    with pytest.raises(KeyError, match="nope"):
        Context.import_("nope")
    imp.release()
    reference.release()
    Context.unexport("prefix")
    assert not host.kv.held and host.kv.free_pages() == 64


def test_async_submit_and_wait_any(host: FakeHost) -> None:
    base = Context()
    base.fill("abc")
    forks = [base.fork() for _ in range(3)]
    passes = [f.submit_decode() for f in forks]
    with pytest.raises(RuntimeError, match="in flight"):
        forks[0].decode_step()
    first = wait_any(passes)
    assert first.done and first.ctx.tokens[-1] == first.result
    for p in passes:
        p.wait()
    assert len({p.result for p in passes}) == 1  # same sequence, greedy: same token
    dist = base.submit_dist(3).wait()
    assert len(dist[0]) == 3 and dist[0][0] == passes[0].result


def test_next_dist_appends_nothing(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("abc")
    ids, probs = ctx.next_dist(4)
    assert len(ids) == len(probs) == 4 and ctx.kv_len == len(ctx.tokens) == 3
    with pytest.raises(RuntimeError, match="no pending token"):
        ctx.decode_step()


def test_out_of_pages_waits_then_raises(host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    small = FakeHost(page_size=PS, num_pages=4).install()
    monkeypatch.setattr(PAGES, "wait_s", 0.05)
    held = PAGES.allocate(2)  # as if another context (or instance) held them
    ctx = Context()
    ctx.fill("x" * 12)  # needs 3 pages: fits the cache, not what is free
    t0 = time.monotonic()
    with pytest.raises(OutOfPages, match="out of KV pages"):
        ctx.flush()
    assert time.monotonic() - t0 >= 0.03  # it waited for pages to free up first
    PAGES.release(held)
    assert small.kv.free_pages() == 4


def test_instance_page_limit_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeHost(page_size=PS, num_pages=64, max_pages=1).install()
    monkeypatch.setattr(PAGES, "wait_s", 60)  # would hang the test if it waited
    ctx = Context()
    ctx.fill("x" * 12)
    with pytest.raises(OutOfPages, match="page limit"):
        ctx.flush()


def test_chat_fills_only_the_new_suffix(host: FakeHost) -> None:
    model = host.model
    with Context() as ctx:
        ctx.fill_system("be brief")
        ctx.fill_user("hi")
        reply = ctx.generate(max_tokens=3)
        ctx.fill_user("again")
        expected = model.apply_chat_template(
            [model.Message("system", "be brief"), model.Message("user", "hi"),
             model.Message("assistant", reply), model.Message("user", "again")], True)  # fmt: skip
        assert model.decode(ctx.tokens) == expected
        assert ctx.messages[2] == {"role": "assistant", "content": reply}


def test_fake_host_traps_on_foreign_page(host: FakeHost) -> None:
    with pytest.raises(FakeTrap, match="not held"):
        host.kv.release([63])


def test_plain_decode_steps_use_decode_step_and_masked_ones_use_run(host: FakeHost) -> None:
    ctx = Context()
    ctx.fill("abcdefg")
    ctx.flush()
    a = ctx.decode_step()  # one pending token, nothing masked: forward.decode-step
    b = ctx.decode_step()
    assert host.forward.decode_step_calls == 2
    step = host.forward.requests[-1]
    assert (step.tokens, step.positions, step.mask, step.last_page_len) == ([a], [7], [], 4)
    assert step.outputs[0].index == 0 and step.outputs[0].sample is not None
    assert ctx.tokens[-2:] == [a, b] and ctx.kv_len == 8
    check_invariants(ctx)

    ctx.mask_token_range(0, 2)  # a masked token: the step needs a mask, so forward.run
    ctx.decode_step()
    assert host.forward.decode_step_calls == 2 and host.forward.requests[-1].mask != []
    check_invariants(ctx)


def test_allocation_larger_than_the_whole_cache_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeHost(page_size=PS, num_pages=8).install()
    monkeypatch.setattr(PAGES, "wait_s", 60)  # would hang the test if it waited
    t0 = time.monotonic()
    with pytest.raises(OutOfPages, match="only 8 in total"):
        PAGES.allocate(9)
    assert time.monotonic() - t0 < 5


def test_the_prefix_cache_is_asked_once_per_pass(host: FakeHost, monkeypatch: pytest.MonkeyPatch) -> None:
    """A miss for the output spec, then a hit for the pass geometry (another instance's pages
    registered in between) sent an output index past the pass; the cache is asked once."""
    answers = iter([[], [0, 1]])  # a miss, then (if asked again) two cached pages

    def attach(tokens: list[int]) -> list[int]:
        host.kv.prefix_lookups.append(list(tokens))
        return next(answers)

    monkeypatch.setattr(host.kv, "attach_prefix", attach)
    ctx = Context()
    ctx.fill_tokens(list(range(3 * PS + 1)))
    token = ctx.decode_step()
    assert len(host.kv.prefix_lookups) == 1
    assert isinstance(token, int) and ctx.kv_len == 3 * PS + 1
    check_invariants(ctx)


def test_the_plain_step_follows_the_mask_through_unmask_fork_and_drop(host: FakeHost) -> None:
    """The context counts its masked tokens instead of scanning them every step: every way the flags
    change (unmasking, a fork's copy, dropping masked pages) must still pick forward.run with a mask
    while a token is masked, and forward.decode-step once none is."""
    ctx = Context()
    ctx.fill("abcdefghijklmnopq")  # 17 tokens
    ctx.flush()
    ctx.mask_token_range(1, 3)
    ctx.decode_step()
    assert host.forward.decode_step_calls == 0 and host.forward.requests[-1].mask != []
    ctx.mask_token_range(0, 3, masked=False)  # nothing masked any more
    assert not ctx.any_masked
    ctx.decode_step()
    assert host.forward.decode_step_calls == 1 and host.forward.requests[-1].mask == []

    ctx.mask_token_range(0, 8)  # two full pages (4 tokens each) masked
    child = ctx.fork()
    assert child.any_masked and child.masked == ctx.masked
    child.decode_step()
    assert host.forward.decode_step_calls == 1 and host.forward.requests[-1].mask != []
    assert ctx.drop_masked_pages() == 2  # the masked tokens leave with their pages
    assert not ctx.any_masked
    ctx.decode_step()
    assert host.forward.decode_step_calls == 2 and host.forward.requests[-1].mask == []
    check_invariants(ctx)
