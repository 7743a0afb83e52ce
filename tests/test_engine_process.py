"""Engine processes (gpu_backend/engine/client.py): the wire format, a stand-in engine in its own
process behind the `Backend` protocol, death noticed at once and the engine restarted, and the
host's config and flags for it. No model, no inferlet build: fast."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import wasmtime

from gpu_backend.engine.client import EngineDied, EngineSpec, ProcessBackend, start_engines
from gpu_backend.engine.wire import (
    decode_requests,
    decode_results,
    encode_requests,
    encode_results,
    pack,
    unpack,
)
from gpu_backend.standin import StandInBackend
from gpu_backend.types import Backend, ForwardError, ForwardRequest, OutputResult, OutputSpec, SamplerParams
from host import Host, HostConfig
from host.cli.options import add_host_options, host_config_from_args

FIXTURES = Path(__file__).parent / "fixtures"
GREEDY = SamplerParams()


def _req(pages: list[int], lpl: int, tokens: list[int], ctx: int, name: str = "r") -> ForwardRequest:
    return ForwardRequest(pages=pages, last_page_len=lpl, tokens=tokens, positions=list(range(ctx, ctx + len(tokens))),
                          outputs=[OutputSpec(index=len(tokens) - 1, sample=GREEDY)], name=name)


def test_wire_round_trip_keeps_every_field() -> None:
    r = ForwardRequest(pages=[3, 9], last_page_len=2, tokens=[5, 6], positions=[4, 5], mask=[[5], [2, 1, 3]],
                       outputs=[OutputSpec(0, SamplerParams(0.7, 40, 0.9, 0.05, 2**63 + 5), dist=3,
                                           allowed=b"\x01\x02\x03\x04"), OutputSpec(1, None, dist=2)],
                       name="inst-1", checked=True)
    back = decode_requests(unpack(pack(encode_requests([r, _req([0], 1, [7], 0)]))))
    assert back[0] == r and back[0].checked and back[0].outputs[0].sample == r.outputs[0].sample
    assert back[1] == _req([0], 1, [7], 0) and not back[1].checked
    res = [[OutputResult(token=4, ids=[4, 1], probs=[0.75, 0.25])], [OutputResult(token=None)]]
    assert decode_results(unpack(pack(encode_results(res)))) == res


@pytest.fixture(scope="module")
def engine() -> Iterator[ProcessBackend]:
    b = ProcessBackend(EngineSpec(standin=True, page_size=4, num_pages=32))
    yield b
    b.close()


@pytest.mark.heavy  # (~4 s: its engine process starts; make test runs it)
def test_process_backend_answers_like_the_in_process_one(engine: ProcessBackend) -> None:
    assert isinstance(engine, Backend)
    assert engine.info.page_size == 4 and engine.info.num_pages == 32 and engine.pid != os.getpid()
    local = StandInBackend(page_size=4, num_pages=32)
    batch = [_req([0, 1], 2, [10, 11, 12, 13, 14, 15], 0, "a"), _req([2], 1, [40], 0, "b")]
    assert engine.forward(batch) == local.forward(batch) == [[OutputResult(token=16)], [OutputResult(token=41)]]
    assert engine.tokenizer.decode(engine.tokenizer.encode("hi")) == "hi"
    engine.copy_tokens(0, 0, 3, 0, 2)


@pytest.mark.heavy  # (its engine process; make test runs it)
def test_embeddings_come_from_the_engine_process(engine: ProcessBackend) -> None:
    # WIT embed's embed-text / embed-image over the engine wire: what the in-process stand-in gives
    local = StandInBackend(page_size=4, num_pages=32)
    assert engine.input_embeddings([5, 6, 255]) == local.input_embeddings([5, 6, 255])
    png = b"\x89PNG\r\n\x1a\n-rest"
    assert engine.embed_image(png, "image/png") == local.embed_image(png, "image/png")
    assert len(engine.embed_image(png, "")) == 3 * 4 * engine.info.hidden_size  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="does not decode"):  # the image's fault: a ValueError, the engine carries on
        engine.embed_image(b"x", "image/png")
    assert engine.input_embeddings([7]) == local.input_embeddings([7])


@pytest.mark.heavy  # (its engine process; make test runs it)
def test_a_bad_request_fails_alone_with_its_index(engine: ProcessBackend) -> None:
    good, bad = _req([4], 1, [7], 0), _req([99], 1, [7], 0, "bad")
    with pytest.raises(ForwardError) as e:
        engine.forward([good, bad])
    assert e.value.request_index == 1 and "99" in str(e.value)
    with pytest.raises(ForwardError) as e:  # past the host-side check: the engine's answers the same
        engine._call("forward", encode_requests([good, bad]))
    assert e.value.request_index == 1 and "99" in str(e.value)
    assert engine.forward([good]) == [[OutputResult(token=8)]]  # the engine carries on


@pytest.mark.slow  # (~7 s: two engine processes start; make test runs it)
def test_a_killed_engine_is_noticed_at_once_and_restarted() -> None:
    b = ProcessBackend(EngineSpec(standin=True, page_size=4, num_pages=16, standin_delay_s=3.0))
    try:
        deaths: list[tuple[str, float]] = []
        b.on_death.append(lambda reason: deaths.append((reason, time.monotonic())))
        errors: list[BaseException] = []

        def call() -> None:
            try:
                b.forward([_req([0], 1, [5], 0)])
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        t = threading.Thread(target=call)
        t.start()
        time.sleep(0.5)  # the forward is running (the stand-in sleeps 3 s)
        old = b.pid
        killed = time.monotonic()
        os.kill(old, signal.SIGKILL)
        t.join(10)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], EngineDied), errors
        assert "SIGKILL" in str(errors[0])
        assert deaths and deaths[0][1] - killed < 1.0 and "SIGKILL" in deaths[0][0]
        assert time.monotonic() - killed < 2.5  # long before the 3 s step would have ended
        assert b.wait_ready(60) and b.pid != old and b.deaths == 1
        b.spec  # noqa: B018 - the same spec serves again
        assert b.forward([_req([0], 1, [5], 0)]) == [[OutputResult(token=6)]]
    finally:
        b.close()
    assert not b.alive


@pytest.mark.heavy  # (~4 s: an engine process starts, imports torch and fails; make test runs it)
def test_an_engine_that_cannot_start_says_why() -> None:
    with pytest.raises(EngineDied, match="not-a-model"):
        ProcessBackend(EngineSpec(model="/nonexistent/not-a-model.gguf"))


@pytest.mark.heavy  # (~4 s: an engine process starts and refuses; make test runs it)
def test_more_ranks_than_gpus_is_refused_with_the_count() -> None:
    """tp x replicas ranks on cuda need that many visible GPUs; fewer is an error, not shared GPUs."""
    import torch

    have = torch.cuda.device_count()
    with pytest.raises(EngineDied, match=rf"--tp 2 x --replicas {have + 1} needs {2 * (have + 1)} GPUs"):
        ProcessBackend(EngineSpec(standin=False, device="cuda", tp=2, replicas=have + 1))


def test_config_fields_and_flags() -> None:
    import argparse

    assert HostConfig().engine_kind == "inproc"
    assert HostConfig(tp=2).engine_kind == "process" and HostConfig(replicas=2).engine_kind == "process"
    assert HostConfig(engine="process").engine_kind == "process"
    for bad in ({"engine": "gpu"}, {"tp": 0}, {"replicas": 0}, {"engine": "inproc", "tp": 2},
                {"engine": "inproc", "replicas": 2}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HostConfig(**bad)  # type: ignore[arg-type]
    ap = argparse.ArgumentParser()
    add_host_options(ap)
    cfg = host_config_from_args(ap.parse_args(["--engine", "process", "--tp", "2", "--replicas", "3"]))
    assert (cfg.engine, cfg.tp, cfg.replicas) == ("process", 2, 3)
    cfg = host_config_from_args(ap.parse_args([]))
    assert (cfg.engine, cfg.tp, cfg.replicas) == ("auto", 1, 1)
    with pytest.raises(SystemExit):
        ap.parse_args(["--engine", "threads"])


@pytest.mark.heavy  # (~8 s: two engine processes; make test runs it)
def test_host_owns_its_engines_and_stops_them(tmp_path: Path) -> None:
    engines = start_engines(EngineSpec(standin=True, page_size=4, num_pages=16), replicas=2)
    pids = [e.pid for e in engines]
    with Host(HostConfig(data_dir=tmp_path), engines=engines) as host:
        assert host.total_pages == 32 and host.free_pages() == 32
        prog = host.compile(bytes(wasmtime.wat2wasm((FIXTURES / "echo.wat").read_text())))
        iid = host.launch(prog, ["x"])
        assert host.wait(iid, 30)
        st = host.stats()["engine"]
        assert st["kind"] == "process" and [r["pid"] for r in st["replicas"]] == pids
    for pid in pids:  # shut down: the engine processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
