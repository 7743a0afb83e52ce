"""Chunked prefill on the real default model (SmolLM2, CPU): a host-side loop, a guest-style forward
with a mask and output indices, and a prefix-cache hit give the same outputs chunked as unchunked,
and the host loop's greedy tokens are transformers' greedy tokens. The scheduler runs the model as
the host binds it (host/host.py); the stand-in's tests: tests/test_chunked_prefill.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gpu_backend.loading.loader import default_model_path
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host.batching.generation import Generation, StopRules
from host.batching.policy import AdaptivePolicy
from host.batching.scheduler import Scheduler
from host.state.pages import InstancePages, PageManager
from host.state.prefix_cache import PrefixCache

pytestmark = pytest.mark.slow

CHUNK = 16  # small, so a prompt of ~56 tokens runs as 4 chunks across page boundaries (pages of 16)
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a screw press into a system that could produce "
          "books quickly and cheaply. Within fifty years presses were working in more than two hundred "
          "cities across Europe, and the")


@pytest.fixture(scope="module")
def rig(backend: Any) -> Iterator[tuple[Any, PageManager, dict[Any, Scheduler]]]:
    """The model behind schedulers that share one page manager: unchunked (0), chunked (CHUNK) and
    `--prefill-chunk auto` ("auto")."""
    pm = PageManager(backend.info.num_pages, None, PrefixCache(backend.info.page_size))
    scheds: dict[Any, Scheduler] = {}
    for chunk in (0, CHUNK, "auto"):
        s = Scheduler(AdaptivePolicy(), prefill_chunk=chunk)
        s.bind(backend.forward, backend.copy_tokens, backend.info.page_size, pins=pm, start=backend.start_forward,
               feeds=bool(getattr(backend, "feeds", False)))
        scheds[chunk] = s
    yield backend, pm, scheds
    for s in scheds.values():
        s.stop()


def _generate(rig: Any, chunk: int | str, prompt: list[int], max_tokens: int, sampler: SamplerParams,
              owner: str, prefix: bool = False, tenant: str = "local", wait: bool = True) -> Any:
    """A host-side loop (what `forward.generate-fresh` runs) from `prompt`: its tokens, and how many
    prompt tokens a prefix-cache hit spared (`prefix`: attach the cached prefix first)."""
    backend, pm, scheds = rig
    ps = backend.info.page_size
    table = InstancePages(owner=owner, tenant=tenant)
    try:
        held = pm.attach_prefix(table, prompt) if prefix else []
        cached = len(held) * ps
        rest = prompt[cached:]
        need = -(-len(prompt) // ps) - len(held)
        pages = pm.allocate(table, need)
        assert isinstance(pages, list)
        req = ForwardRequest(pages=held + pages, last_page_len=len(prompt) - (len(held) + need - 1) * ps,
                             tokens=list(rest), positions=list(range(cached, len(prompt))),
                             outputs=[OutputSpec(index=len(rest) - 1, sample=sampler)], name=owner, checked=True)
        pm.note_write(table, req, ps)
        gen = Generation(req, sampler, StopRules(max_tokens, frozenset(), (), 8192), ps, pm, table,
                         backend.tokenizer.decode, None)
        fut = scheds[chunk].submit(req, owner, generation=gen)
        if not wait:  # (the caller waits, then releases the pages)
            return fut, table
        res = fut.wait(120)
        return list(res.tokens), cached
    finally:
        if wait:
            pm.release_all(table)


def test_a_host_loop_gives_the_same_tokens_chunked_and_as_transformers(rig: Any) -> None:
    backend = rig[0]
    prompt = backend.tokenizer.encode_prompt(PROMPT)
    assert len(prompt) > 3 * CHUNK
    chunks0 = rig[2][CHUNK].stats.prefill_chunks
    whole, _ = _generate(rig, 0, prompt, 16, SamplerParams(), "g0")
    chunked, _ = _generate(rig, CHUNK, prompt, 16, SamplerParams(), "g1")
    assert chunked == whole
    assert rig[2][CHUNK].stats.prefill_chunks - chunks0 == -(-len(prompt) // CHUNK)
    seeded = SamplerParams(temperature=0.8, top_p=0.95, seed=1234)
    assert _generate(rig, CHUNK, prompt, 16, seeded, "g2")[0] == _generate(rig, 0, prompt, 16, seeded, "g3")[0]
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert out[0, len(prompt):].tolist() == chunked


def test_a_prefix_cache_hit_prefills_the_rest_in_chunks_the_same(rig: Any) -> None:
    """Each run in a tenant of its own (the cache is per client), after the same prompt filled it."""
    backend = rig[0]
    prompt = backend.tokenizer.encode_prompt(PROMPT)
    longer = prompt + backend.tokenizer.encode(" Printing presses soon spread to the New World, where the first "
                                               "printers worked in Mexico City and later in Cambridge,")
    out = {}
    chunks0 = rig[2][CHUNK].stats.prefill_chunks
    for chunk in (0, CHUNK):
        tenant = f"t{chunk}"
        _generate(rig, 0, prompt, 2, SamplerParams(), f"fill{chunk}", tenant=tenant)  # fills the cache
        out[chunk] = _generate(rig, chunk, longer, 12, SamplerParams(), f"hit{chunk}", prefix=True, tenant=tenant)
    (whole, hit0), (chunked, hit1) = out[0], out[CHUNK]
    assert hit0 == hit1 == 3 * backend.info.page_size  # the cached pages were attached
    assert len(longer) - hit1 > CHUNK  # and the rest ran in chunks
    assert rig[2][CHUNK].stats.prefill_chunks - chunks0 == -(-(len(longer) - hit1) // CHUNK)
    assert chunked == whole


def _window_rows(context: int, n: int, window: int) -> list[list[int]]:
    """BRLE rows: token i attends to the last `window` tokens up to itself (masked before them)."""
    rows = []
    for i in range(n):
        seen = context + i + 1
        masked = max(seen - window, 0)
        rows.append([0, masked, seen - masked] if masked else [seen])
    return rows


def test_a_forward_with_a_mask_and_output_indices_gives_the_same_outputs_chunked(rig: Any) -> None:
    backend, pm, scheds = rig
    ps = backend.info.page_size
    prompt = backend.tokenizer.encode_prompt(PROMPT)
    n = len(prompt)
    outputs = [OutputSpec(index=n - 1, sample=SamplerParams(), dist=5), OutputSpec(index=3, dist=5),
               OutputSpec(index=CHUNK + 1, sample=SamplerParams(temperature=1.0, seed=9), dist=5),
               OutputSpec(index=2 * CHUNK - 1, dist=5, target=prompt[2 * CHUNK])]
    got = {}
    for chunk in (0, CHUNK):
        table = InstancePages(owner=f"m{chunk}")
        try:
            pages = pm.allocate(table, -(-n // ps))
            assert isinstance(pages, list)
            req = ForwardRequest(pages=pages, last_page_len=n - (len(pages) - 1) * ps, tokens=list(prompt),
                                 positions=list(range(n)), mask=_window_rows(0, n, 20), outputs=list(outputs),
                                 name=f"m{chunk}")
            got[chunk] = scheds[chunk].submit(req, f"m{chunk}").wait(120)
        finally:
            pm.release_all(table)
    for a, b in zip(got[0], got[CHUNK], strict=True):
        assert a.token == b.token and a.ids == b.ids
        assert a.probs == pytest.approx(b.probs, abs=1e-4)
        assert (a.logprob is None) == (b.logprob is None)
        if a.logprob is not None:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-3)


def test_auto_chunks_a_prompt_among_running_decodes_by_the_cpu_cost_and_gives_the_same_tokens(rig: Any) -> None:
    """`--prefill-chunk auto` on the model on CPU: 4 host loops decode (their 24-token prompts and
    their steps give the cost fit its range), the prompt arrives among them and is split into
    chunks of the budget the fit gives (a token costs about a step's fixed part on CPU: a few
    tokens); every loop's tokens and the prompt's are the unchunked run's."""
    backend, pm, scheds = rig
    prompt = backend.tokenizer.encode_prompt(PROMPT)
    starts = [backend.tokenizer.encode_prompt(f"Count from {k} upward in words, one per line:")[:24] for k in range(4)]
    out: dict[Any, list[list[int]]] = {}
    for chunk in (0, "auto"):
        s = scheds[chunk]
        before, batches = s.stats.chunked_prefills, s.stats.batches
        loops = [_generate(rig, chunk, p, 24, SamplerParams(), f"l{chunk}{k}", wait=False) for k, p in enumerate(starts)]
        while s.stats.batches < batches + 3:  # their prefill and two steps: the loops are decoding
            threading.Event().wait(0.01)
        long_tokens, _ = _generate(rig, chunk, prompt, 4, SamplerParams(), f"p{chunk}")
        out[chunk] = [long_tokens]
        for fut, table in loops:
            out[chunk].append(list(fut.wait(300).tokens))
            pm.release_all(table)
        if chunk == "auto":
            st = s.stats
            assert st.chunked_prefills - before >= 1, st  # the prompt ran in chunks among the decodes
            assert 1 <= st.prefill_budget < len(prompt), st
            assert st.step_token_us > 0, st
    assert out["auto"] == out[0]
