"""Sandbox: misbehaving instances end with a clear reason while well-behaved ones are unaffected.

Runs on the fake backend (fast, deterministic: the token after t is t+1), so a
well-behaved instance's output is known independently of the code under test.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import wasmtime
from fakes import FakeBackend
from helpers import FIXTURES, Run, wait_for, wasm_bytes

from host import Host, HostConfig
from host.wasm.engine import CompileError

BAD_MODES = {
    "invalid_page": "page 1000000 is not held by this instance",
    "double_release": "double release",
    "too_many_tokens": "do not fit",
    "bad_mask": "mask row 1 covers 1 tokens, expected 2",
    "bad_handle": "unknown forward handle 12345",
    "decode_invalid_page": "forward.decode-step: page 1000000 is not held by this instance",
    "decode_bad_len": "forward.decode-step: last-page-len 5 is outside 1..4",
    "decode_repeated_page": "forward.decode-step: the page list repeats a page",
    "decode_bad_token": "forward.decode-step: token 1000000 is outside the vocabulary (size 256)",
    "decode_bad_sampler": "forward.decode-step: sampler: temperature must be a finite number >= 0",
    "exception": "ValueError: boom from the guest",
    "memory": "MemoryError",
}


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    cfg = HostConfig(wall_budget_s=20.0, memory_limit_bytes=128 * 2**20,
                     data_dir=tmp_path_factory.mktemp("data"))
    h = Host(cfg, backend=FakeBackend(page_size=4, num_pages=256, delay_s=0.002))
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def misbehave(host: Host) -> str:
    return host.compile(wasm_bytes("misbehave"))


def expected_generation(prompt: list[int], n: int) -> str:
    return " ".join(str(prompt[-1] + 1 + i) for i in range(n))


def start_good(host: Host, program: str, k: int) -> list[tuple[Run, str]]:
    runs = []
    for i in range(k):
        prompt = [10 + 20 * i, 11 + 20 * i, 12 + 20 * i, 13 + 20 * i, 14 + 20 * i]
        runs.append((Run(host, program, ["generate", "24", *map(str, prompt)]), expected_generation(prompt, 24)))
    return runs


@pytest.mark.build
def test_an_allocation_larger_than_the_cache_ends_with_out_of_resources_at_once(host: Host, misbehave: str) -> None:
    free0 = host.free_pages()
    good = start_good(host, misbehave, 3)
    end = Run(host, misbehave, ["huge_alloc"]).finish(60)
    assert end.event == "out_of_resources", end
    assert "needs 1000000000 KV pages" in end.message and "whole cache has 256" in end.message
    for run, want in good:
        ev = run.finish(60)
        assert (ev.event, ev.message) == ("completed", want)
    assert host.free_pages() == free0


@pytest.mark.parametrize("mode", sorted(BAD_MODES))
@pytest.mark.build
def test_bad_instance_trapped_others_unaffected(host: Host, misbehave: str, mode: str) -> None:
    free0 = host.free_pages()
    good = start_good(host, misbehave, 3)
    bad = Run(host, misbehave, [mode])
    end = bad.finish(60)
    assert end.event == "exception", end
    assert BAD_MODES[mode] in end.message
    for run, want in good:
        ev = run.finish(60)
        assert (ev.event, ev.message) == ("completed", want)
    assert host.free_pages() == free0


@pytest.mark.build
def test_foreign_page_id_traps(host: Host, misbehave: str) -> None:
    free0 = host.free_pages()
    holder = Run(host, misbehave, ["holder", "page-of-holder"])
    thief = Run(host, misbehave, ["foreign", "page-of-holder"])
    end = thief.finish(30)
    assert end.event == "exception" and "is not held by this instance" in end.message
    host.signal(holder.id, "go")
    assert holder.finish(30).message == "held"
    assert host.free_pages() == free0


@pytest.mark.build
def test_infinite_loop_stopped_by_terminate(host: Host, misbehave: str) -> None:
    free0 = host.free_pages()
    good = start_good(host, misbehave, 2)
    spin = Run(host, host.compile(wasm_bytes("loop")), [])
    py_spin = Run(host, misbehave, ["loop"])
    wait_for(lambda: {i["id"]: i["state"] for i in host.instances()}.get(py_spin.id) == "running",
             what="the spinning guests to run")
    t0 = time.perf_counter()
    host.terminate(spin.id, "stop it")
    host.terminate(py_spin.id, "stop it too")
    assert spin.finish(10).event == "aborted" and spin.end is not None and spin.end.message == "stop it"
    assert py_spin.finish(10).event == "aborted"
    assert time.perf_counter() - t0 < 2.0
    for run, want in good:
        assert run.finish(60).message == want
    assert host.free_pages() == free0


@pytest.mark.build
def test_terminate_while_blocked_in_forward_loop_frees_pages(host: Host, misbehave: str) -> None:
    free0 = host.free_pages()
    run = Run(host, misbehave, ["sleep_forward"])
    wait_for(lambda: host.free_pages() < free0, what="the guest to allocate")
    host.terminate(run.id)
    assert run.finish(10).event == "aborted"
    assert host.free_pages() == free0


def test_wall_budget_stops_a_spinning_guest(tmp_path) -> None:
    h = Host(HostConfig(wall_budget_s=0.5, data_dir=tmp_path), backend=FakeBackend())
    try:
        end = Run(h, h.compile(wasm_bytes("loop")), []).finish(10)
        assert end.event == "exception" and "wall-clock budget of 0.5 s exceeded" in end.message
    finally:
        h.shutdown()


def test_wat_fixtures_memory_bomb_and_bad_page(host: Host) -> None:
    free0 = host.free_pages()
    end = Run(host, host.compile(wasm_bytes("memory_bomb")), []).finish(30)
    assert end.event == "exception" and "unreachable" in end.message
    end = Run(host, host.compile(wasm_bytes("bad_page")), []).finish(30)
    assert end.event == "exception"
    assert end.message == "kv.release: page 999999 is not held by this instance (foreign id or double release)"
    assert host.free_pages() == free0


def test_a_component_built_against_wit_0_2_0_still_runs(host: Host) -> None:
    end = Run(host, host.compile(wasm_bytes("v0_2_component")), []).finish(30)
    assert end.event == "completed", end.message


def test_a_component_built_against_wit_0_3_0_still_runs(host: Host) -> None:
    end = Run(host, host.compile(wasm_bytes("v0_3_component")), []).finish(30)
    assert end.event == "completed", end.message


def test_a_component_built_against_wit_0_4_0_still_runs(host: Host) -> None:
    end = Run(host, host.compile(wasm_bytes("v0_4_component")), []).finish(30)
    assert end.event == "completed", end.message
    # and 0.4.0 never had interface embed: a component asking for it does not link
    wat = (FIXTURES / "v0_4_component.wat").read_text().replace("kv@0.4.0", "embed@0.4.0").replace(
        '"page-size" (func (result u32))', '"hidden-size" (func (result u32))').replace(
        'alias export $kv "page-size"', 'alias export $kv "hidden-size"')
    end = Run(host, host.compile(bytes(wasmtime.wat2wasm(wat))), []).finish(30)
    assert end.event == "exception" and "embed@0.4.0" in end.message, end.message


def test_set_priority_takes_a_value_in_range_and_traps_one_out_of_range(host: Host) -> None:
    end = Run(host, host.compile(wasm_bytes("set_priority")), []).finish(30)
    assert end.event == "exception"
    assert end.message == "runtime.set-priority: priority must be from -1000 to 1000 (lower runs sooner), got 5000"


def test_invalid_component_is_rejected(host: Host) -> None:
    with pytest.raises(CompileError):
        host.compile(b"\0asm not really")
    with pytest.raises(KeyError, match="unknown program"):
        host.launch("0" * 64, [])


@pytest.mark.build
def test_backend_failure_ends_instances_of_that_batch(host: Host, misbehave: str) -> None:
    backend = host.backend
    backend.fail_next = True
    end = Run(host, misbehave, ["ok"]).finish(30)
    assert end.event == "exception" and "injected backend failure" in end.message
    assert Run(host, misbehave, ["ok"]).finish(30).message == "6"  # the host carries on


@pytest.mark.build
def test_messages_and_closed_input(host: Host, misbehave: str) -> None:
    run = Run(host, misbehave, ["echo"])
    host.signal(run.id, "a")
    host.signal(run.id, "b")
    host.close_input(run.id)
    end = run.finish(30)
    assert run.messages == ["echo: a", "echo: b"] and end.message == "2 messages"


@pytest.mark.build
def test_adaptive_batching_merges_instances(host: Host, misbehave: str) -> None:
    before = host.scheduler.stats.as_dict()
    runs = start_good(host, misbehave, 8)
    for run, want in runs:
        assert run.finish(60).message == want
    after = host.scheduler.stats.as_dict()
    forwards = after["forwards"] - before["forwards"]
    batches = after["batches"] - before["batches"]
    assert forwards / batches > 1.5, (forwards, batches)


@pytest.mark.build
def test_out_of_pages_is_a_condition_and_the_sdk_waits(tmp_path) -> None:
    """A full cache makes allocation fail softly: the SDK waits, nobody is killed, all finish."""
    h = Host(HostConfig(data_dir=tmp_path), backend=FakeBackend(page_size=4, num_pages=8))
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        hog = Run(h, prog, ["hog", "7"])
        hog.messages.append(hog.events.get(timeout=60).message)
        assert hog.messages == ["holding"]
        assert h.free_pages() == 1
        prompt = [10, 11, 12, 13, 14, 15]  # + 8 generated tokens: 4 pages of 4
        refused = h.pages.refused
        gen = Run(h, prog, ["generate", "8", *map(str, prompt)])
        wait_for(lambda: h.pages.refused >= refused + 2, what="the SDK to retry its allocation")
        assert gen.end is None and gen.events.empty()  # still waiting for pages, not killed
        h.signal(hog.id, "done")
        assert hog.finish(30).message == "released"
        end = gen.finish(30)
        assert (end.event, end.message) == ("completed", expected_generation(prompt, 8))
        assert h.free_pages() == 8
    finally:
        h.shutdown()


@pytest.mark.build
def test_copy_tokens_runs_after_the_instances_earlier_forwards(tmp_path) -> None:
    """kv.copy-tokens goes through the scheduler: it copies what a forward submitted before it wrote."""
    fb = FakeBackend(page_size=4, num_pages=16, delay_s=0.05)
    h = Host(HostConfig(data_dir=tmp_path), backend=fb)
    try:
        end = Run(h, h.compile(wasm_bytes("misbehave")), ["copy_after_submit"]).finish(60)
        assert end.event == "completed", end.message
        a, b = map(int, end.message.split())
        assert [fb.slots.get((b, i)) for i in range(3)] == [7, 8, 9]
        assert h.scheduler.stats.copies == 1
    finally:
        h.shutdown()


@pytest.mark.build
def test_a_released_page_is_not_reused_while_a_queued_forward_still_writes_it(tmp_path) -> None:
    """Issue 11.1: the attacker releases page P while its own write into P is still queued; the
    victim's prefill must never be overwritten by that write."""
    fb = FakeBackend(page_size=4, num_pages=16, delay_s=0.4)
    h = Host(HostConfig(data_dir=tmp_path), backend=fb)
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        free0 = h.free_pages()
        victim = Run(h, prog, ["victim", "released-11-1"])
        attacker = Run(h, prog, ["release_queued", "released-11-1"])
        assert attacker.finish(60).event == "completed"
        end = victim.finish(60)
        assert end.event == "completed", end.message
        page = int(end.message)
        assert [fb.slots.get((page, i)) for i in range(4)] == [10, 11, 12, 13]  # the victim's own K/V
        wait_for(lambda: h.free_pages() == free0, what="every page back")
    finally:
        h.shutdown()


@pytest.mark.build
def test_another_tenant_cannot_see_import_or_remove_a_persistent_export(host: Host, misbehave: str) -> None:
    """Issue 11.8: export names belong to the tenant (client identity) that launched the exporter."""
    free0 = host.free_pages()
    good = start_good(host, misbehave, 2)

    def run_as(tenant: str, *args: str) -> str:
        r = Run(host, misbehave, list(args), tenant=tenant)
        return r.finish(30).message

    assert run_as("alice", "export", "kept-11-8") == "exported"
    assert run_as("mallory", "import", "kept-11-8") == "error: no export named 'kept-11-8'"
    assert run_as("mallory", "unexport", "kept-11-8") == "error: no export named 'kept-11-8'"
    assert run_as("alice", "import", "kept-11-8") == "imported 1"
    assert run_as("alice", "unexport", "kept-11-8") == "unexported"
    for run, want in good:
        assert run.finish(60).message == want
    assert host.free_pages() == free0


@pytest.mark.build
def test_unread_published_messages_are_bounded_and_freed_with_their_subscriber(tmp_path) -> None:
    """Issue 11.5: a subscriber that never reads holds at most its mailbox limits, and nothing after it ends."""
    h = Host(HostConfig(data_dir=tmp_path, max_published_messages=100, max_published_bytes=64 * 1024),
             backend=FakeBackend())
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        idle = Run(h, prog, ["subscribe_idle", "news-11-5"])
        assert idle.events.get(timeout=60).message == "subscribed"
        assert Run(h, prog, ["flood", "news-11-5", "2000", "1000"]).finish(60).message == "flooded"
        mailbox = h._instances[idle.id].published
        assert len(mailbox) <= 100 and mailbox.bytes <= 64 * 1024 and mailbox.dropped >= 2000 - 100
        end = Run(h, prog, ["flood", "news-11-5", "1", str(70 * 1024)]).finish(60)
        assert end.event == "exception" and "exceeds the 65536-byte limit" in end.message
        h.signal(idle.id, "go")
        assert idle.finish(30).message == "done"
        assert len(mailbox) == 0 and mailbox.bytes == 0 and h.topics.topic_count() == 0
    finally:
        h.shutdown()


@pytest.mark.build
def test_a_page_attached_from_the_prefix_cache_is_read_only(host: Host, misbehave: str) -> None:
    """Issue 15: an instance that attaches cached pages cannot write into them; co-runners unaffected."""
    free0 = host.free_pages()
    good = start_good(host, misbehave, 2)
    assert Run(host, misbehave, ["prefill_release"]).finish(30).message == "released"
    attacker = Run(host, misbehave, ["attach_write"])
    end = attacker.finish(30)
    assert attacker.messages == ["attached 2"]
    assert end.event == "exception" and "read-only" in end.message and end.message.startswith("forward.run")
    for run, want in good:
        assert run.finish(60).message == want
    assert host.free_pages() == free0


@pytest.mark.build
def test_every_context_path_works_after_a_prefix_cache_hit(host: Host, misbehave: str) -> None:
    """Issue 15: decode_step, next_dist, flush and submit_decode on a context that starts from cached pages."""
    hits0 = host.stats()["prefix_cache"]["hits"]
    end = Run(host, misbehave, ["prefix_paths"]).finish(60)
    assert (end.event, end.message) == ("completed", " ".join([str(ord("x") + 1)] * 5))
    assert host.stats()["prefix_cache"]["hits"] - hits0 >= 4  # the first fill misses, the next four hit
