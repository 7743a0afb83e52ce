"""beam_search inferlet: same result and score as a reference beam search on gpu_backend; >= greedy."""

from __future__ import annotations

import json
import math

import pytest
from helpers import Run, wasm_bytes

from gpu_backend.types import ForwardRequest, OutputSpec
from host import Host

pytestmark = pytest.mark.slow

PROMPT = "Name a color."


@pytest.fixture(scope="module")
def host(real_host):
    return real_host


def _ranked_candidates(beams: list[dict], outs) -> list[tuple[float, int, int, int]]:
    """Every (score, beam index, rank, token) continuation, best first (ties: lower beam, then rank)."""
    cands = []
    for bi, (b, out) in enumerate(zip(beams, outs, strict=False)):
        for rank, (tok, prob) in enumerate(zip(out[0].ids, out[0].probs, strict=False)):
            if prob > 0.0:
                cands.append((b["score"] + math.log(prob), bi, rank, tok))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    return cands


def reference_beam_search(host: Host, prompt_ids: list[int], width: int, max_tokens: int,
                          penalty: float) -> tuple[float, list[int]]:
    """The inferlet's algorithm written directly against the backend (own pages, copied on fork)."""
    be = host.backend
    ps = be.info.page_size
    stops = set(be.info.stop_tokens)
    pool = list(range(be.info.num_pages - 1, be.info.num_pages - 400, -1))  # pages no instance holds now

    forward = be.forward  # the backend serializes its own calls, so this can run beside the host

    def grow(beam, n):  # make room for n more tokens
        need = -(-(beam["kv"] + n) // ps) - len(beam["pages"])
        beam["pages"] += [pool.pop() for _ in range(max(need, 0))]

    root = {"pages": [], "kv": 0, "pending": prompt_ids[-1], "score": 0.0, "toks": []}
    grow(root, len(prompt_ids) - 1)
    forward([ForwardRequest(pages=root["pages"], last_page_len=len(prompt_ids) - 1 - (len(root["pages"]) - 1) * ps,
                            tokens=prompt_ids[:-1], positions=list(range(len(prompt_ids) - 1)))])
    root["kv"] = len(prompt_ids) - 1
    beams, finished = [root], []
    for _ in range(max_tokens):
        reqs = []
        for b in beams:
            grow(b, 1)
            b["kv"] += 1
            reqs.append(ForwardRequest(pages=b["pages"], last_page_len=b["kv"] - (len(b["pages"]) - 1) * ps,
                                       tokens=[b["pending"]], positions=[b["kv"] - 1],
                                       outputs=[OutputSpec(index=0, dist=width)]))
        cands = _ranked_candidates(beams, forward(reqs))
        new = []
        for score, bi, _rank, tok in cands[:width]:
            parent = beams[bi]
            if tok in stops:
                finished.append((score, parent["toks"] + [tok]))
                continue
            child = {"pages": [pool.pop() for _ in parent["pages"]], "kv": parent["kv"], "pending": tok,
                     "score": score, "toks": parent["toks"] + [tok]}
            for src, dst in zip(parent["pages"], child["pages"], strict=False):
                be.copy_tokens(src, 0, dst, 0, ps)
            new.append(child)
        for b in beams:
            pool.extend(b["pages"])
        beams = new
        if not beams or len(finished) >= width:
            break
    hyps = finished + [(b["score"], b["toks"]) for b in beams]
    return max(hyps, key=lambda h: h[0] / (max(len(h[1]), 1) ** penalty))


@pytest.mark.parametrize("width,max_tokens,penalty", [(3, 10, 1.0), (2, 12, 0.0)])
def test_beam_search_matches_reference_and_beats_greedy(host, width, max_tokens, penalty) -> None:
    prog = host.compile(wasm_bytes("beam_search"))
    run = Run(host, prog, ["--prompt", PROMPT, "--beam-width", str(width), "--max-tokens", str(max_tokens),
                           "--length-penalty", str(penalty), "--json"])
    ev = run.finish()
    assert ev.event == "completed", ev.message
    got = json.loads(ev.message)
    tok = host.backend.tokenizer
    prompt_ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True))
    ref_logprob, ref_tokens = reference_beam_search(host, prompt_ids, width, max_tokens, penalty)
    assert got["tokens"] == ref_tokens
    assert got["logprob"] == pytest.approx(ref_logprob, abs=1e-4)
    greedy_logprob, greedy_tokens = reference_beam_search(host, prompt_ids, 1, max_tokens, 0.0)
    assert greedy_tokens == host.backend.generate(prompt_ids, max_tokens)[: len(greedy_tokens)]
    if penalty == 0.0:
        assert got["logprob"] >= greedy_logprob - 1e-6
    else:  # compare like with like: the same number of tokens
        assert got["logprob"] / len(got["tokens"]) ** penalty >= greedy_logprob / len(greedy_tokens) ** penalty - 1e-6
