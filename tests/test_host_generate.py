"""forward.generate, the host-side generation loop, through the real host on the stand-in backend.

The stand-in's model is fixed (next token = last + 1, stop token 0), so each expected output is
known without the code under test. Sandbox guarantees hold for the new call: a bad argument traps
its caller only, pages grow from the instance's quota and are freed however it ends, terminate
and the wall-clock budget stop a long loop, and the loop's steps batch with other instances.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fakes import FakeBackend
from helpers import Run, wait_for, wasm_bytes

from host import Host, HostConfig

pytestmark = pytest.mark.build

PS = 4


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Host, FakeBackend, str]]:
    fb = FakeBackend(page_size=PS, num_pages=256, delay_s=0.002)
    h = Host(HostConfig(data_dir=tmp_path_factory.mktemp("gen"), max_pages_per_instance=64), backend=fb)
    yield h, fb, h.compile(wasm_bytes("misbehave"))
    h.shutdown()


def test_loop_grows_pages_and_stops_at_max_tokens(rig) -> None:  # noqa: ANN001
    h, fb, prog = rig
    free0 = h.free_pages()
    tokens0 = h.scheduler.stats.tokens
    end = Run(h, prog, ["gen_raw", "30"]).finish(60)
    assert h.scheduler.stats.tokens - tokens0 == 30  # the pending token + 29 drawn ones went through
    # 30 tokens drawn after token 5; the pending token plus 29 drawn ones are written: 30 slots,
    # 1 page given + 7 grown (page size 4)
    assert (end.event, end.message) == ("completed", "30 LENGTH 7")
    assert h.free_pages() == free0


def test_stop_token_ends_the_loop_and_text_equals_the_guest_loop(rig) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    # the stand-in counts up from the prompt's last byte and wraps to the stop token 0
    end = Run(h, prog, ["gen_compare", "7", "0", "400"]).finish(60)
    on_host, in_guest = end.message.split("|||")
    assert on_host == in_guest and len(on_host) > 10


def test_quota_ends_the_loop_with_out_of_pages(rig) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    free0 = h.free_pages()
    end = Run(h, prog, ["gen_raw", "1000"]).finish(60)
    # the instance's limit is 64 pages: 256 slots written, then the next token has no page
    assert end.message == f"{64 * PS} OUT_OF_PAGES 63"
    assert h.free_pages() == free0


@pytest.mark.parametrize("bad", ["0"])
def test_a_bad_argument_traps_the_caller_only(rig, bad: str) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    free0 = h.free_pages()
    good = Run(h, prog, ["generate", "20", "10", "11"])
    end = Run(h, prog, ["gen_raw", bad]).finish(60)
    assert end.event == "exception" and end.message.startswith("forward.generate: max-tokens must be >= 1")
    assert good.finish(60).message == " ".join(str(12 + i) for i in range(20))
    # (its last decode-step run ahead, never claimed, holds its pages until it has run)
    wait_for(lambda: h.free_pages() == free0, 5, "the stepping guest's pages back")


def test_terminate_stops_a_long_loop_and_frees_its_pages(tmp_path) -> None:  # noqa: ANN001
    fb = FakeBackend(page_size=PS, num_pages=4096, delay_s=0.005)
    h = Host(HostConfig(data_dir=tmp_path), backend=fb)
    try:
        prog = h.compile(wasm_bytes("misbehave"))
        free0 = h.free_pages()
        run = Run(h, prog, ["gen_raw", "100000"])
        wait_for(lambda: h.free_pages() < free0 - 3, what="the loop to grow its pages")
        h.terminate(run.id, "stop generating")
        assert run.finish(10).event == "aborted"
        wait_for(lambda: h.free_pages() == free0, what="the loop's pages back")
        assert not h.scheduler._loops.resident and not h.scheduler._loops.ahead
    finally:
        h.shutdown()


def test_loops_of_many_instances_share_batches(rig) -> None:  # noqa: ANN001
    h, fb, prog = rig
    fb.batches.clear()
    runs = [Run(h, prog, ["gen_raw", "40"]) for _ in range(8)]
    for r in runs:
        assert r.finish(60).message.split()[0] == "40"
    assert max(fb.batches) == 8 and sum(fb.batches) / len(fb.batches) > 4


# forward.generate-fresh: the same loop over pages the host takes itself (the prefix cache's, then
# fresh ones from the quota). The stand-in draws last + 1, so every expected output is known.

def test_generate_fresh_takes_its_pages_and_draws_what_generate_draws(rig) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    free0, tokens0 = h.free_pages(), h.scheduler.stats.tokens
    end = Run(h, prog, ["gen_fresh", "10", "0", "5", "6", "7", "8", "9", "10"]).finish(60)
    # 6 pending + 9 drawn tokens written: 15 slots, 4 pages of 4; drawn: 11..20
    assert (end.event, end.message) == ("completed", "LENGTH 4 : " + " ".join(str(t) for t in range(11, 21)))
    assert h.scheduler.stats.tokens - tokens0 == 6 + 9
    assert h.free_pages() == free0


def test_generate_fresh_attaches_the_cached_prefix_and_prefills_only_the_rest(rig) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    assert Run(h, prog, ["prefill_release"]).finish(30).message == "released"  # caches 20..28 at 0..8
    prompt = [str(t) for t in range(20, 30)]
    for prefix, prefilled, hits in (("1", 2, 1), ("0", 10, 0)):
        hits0, tokens0, free0 = h.stats()["prefix_cache"]["hits"], h.scheduler.stats.tokens, h.free_pages()
        end = Run(h, prog, ["gen_fresh", "3", prefix, *prompt]).finish(60)
        # 10 prompt tokens + 2 drawn written: 12 slots in 3 pages, the first two cached with the prefix
        assert end.message == "LENGTH 3 : 30 31 32"
        assert h.scheduler.stats.tokens - tokens0 == prefilled + 2  # a hit prefills only tokens 28, 29
        assert h.stats()["prefix_cache"]["hits"] - hits0 == hits
        assert h.free_pages() == free0


def test_generate_fresh_past_the_page_limit_ends_with_out_of_resources_holding_nothing(rig) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    free0 = h.free_pages()
    # 300 tokens need 75 pages: over the instance's limit of 64, it can never fit
    end = Run(h, prog, ["gen_fresh", "5", "1", *["7"] * 300]).finish(60)
    assert end.event == "out_of_resources" and "instance page limit" in end.message and "limit 64" in end.message
    assert h.free_pages() == free0


@pytest.mark.parametrize(("args", "why"), [(["0", "1", "5", "6"], "max-tokens must be >= 1"),
                                           (["4", "1"], "no pending tokens")])
def test_generate_fresh_bad_arguments_trap_the_caller_only(rig, args: list[str], why: str) -> None:  # noqa: ANN001
    h, _fb, prog = rig
    free0 = h.free_pages()
    good = Run(h, prog, ["generate", "20", "10", "11"])
    end = Run(h, prog, ["gen_fresh", *args]).finish(60)
    assert end.event == "exception" and end.message.startswith(f"forward.generate-fresh: {why}")
    assert good.finish(60).message == " ".join(str(12 + i) for i in range(20))
    # (its last decode-step run ahead, never claimed, holds its pages until it has run)
    wait_for(lambda: h.free_pages() == free0, 5, "the stepping guest's pages back")
