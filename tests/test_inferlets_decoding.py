"""Decoding-technique inferlets end to end on the real model, each checked for its defining property."""

from __future__ import annotations

import json

import pytest
from helpers import Run, wasm_bytes

from host import Host

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def host(real_host):
    return real_host


def run_json(host: Host, name: str, args: list[str], timeout: float = 180.0) -> dict:
    prog = host.compile(wasm_bytes(name))
    ev = Run(host, prog, [*args, "--json"]).finish(timeout)
    assert ev.event == "completed", ev.message
    return json.loads(ev.message)


def chat_ids(host: Host, prompt: str) -> list[int]:
    tok = host.backend.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))


def test_parallel_generation_prefills_the_prefix_once(host) -> None:
    prompt = "Suggest a name for a small boat that sails on a quiet lake in the mountains."
    prog = host.compile(wasm_bytes("parallel_generation"))  # compile before counting
    before = host.scheduler.stats.tokens
    out = run_json(host, "parallel_generation", ["--prompt", prompt, "--num", "4", "--max-tokens", "8"])
    forwarded = host.scheduler.stats.tokens - before
    assert prog
    p = len(chat_ids(host, prompt))
    assert out["prompt_tokens"] == p
    assert len(out["answers"]) == 4 and len(set(out["answers"])) > 1  # differently seeded branches
    # prefix (all but its last token) once, then one token per decode step per branch
    assert forwarded == out["forwarded_tokens"] == (p - 1) + sum(out["generated_tokens"])
    assert forwarded < 2 * p  # re-prefilling per branch would cost 4 * p


def test_constrained_json_always_parses(host) -> None:
    prog = host.compile(wasm_bytes("constrained_json"))
    runs = [Run(host, prog, ["--seed", str(s), "--temperature", "1.0", "--max-tokens", "24", "--json"])
            for s in range(10)]
    texts = []
    for r in runs:
        ev = r.finish(240)
        assert ev.event == "completed", ev.message
        texts.append(json.loads(ev.message)["text"])
    for t in texts:
        assert isinstance(json.loads(t), dict), t
    assert len(set(texts)) > 1  # sampling really happened


def test_speculative_decoding_equals_greedy_with_fewer_passes(host) -> None:
    prompt = "Repeat this list exactly, twice: red, green, blue, yellow, purple, orange, black, white."
    out = run_json(host, "speculative_decoding", ["--prompt", prompt, "--max-tokens", "40"])
    greedy = host.backend.generate(chat_ids(host, prompt), 40)
    assert out["tokens"] == greedy
    assert out["passes"] < len(out["tokens"])
    assert out["accepted"] == len(out["tokens"]) - out["passes"]


def test_windowed_attention_bounds_pages_over_512_tokens(host) -> None:
    sink, window = 4, 32
    out = run_json(host, "windowed_attention", ["--max-tokens", "512", "--sink", str(sink), "--window",
                                                str(window), "--ignore-stop"], timeout=300)
    ps = host.backend.info.page_size
    assert out["tokens"] == 512
    steps = out["pages_per_step"]
    bound = 1 + window // ps + 2  # the sink's page, the window, a partial page and one being filled
    assert max(steps) <= bound, max(steps)
    prompt_pages = -(-len(chat_ids(host, "Tell me a long story about a dragon who learns to cook.")) // ps)
    assert max(steps[-100:]) <= bound and 512 // ps + prompt_pages > 2 * bound  # unbounded would be far more


def test_tree_of_thought_chooses_the_best_scored_branch(host) -> None:
    depth, branch, keep = 2, 3, 2
    out = run_json(host, "tree_of_thought", ["--depth", str(depth), "--branch", str(branch), "--keep", str(keep),
                                             "--step-tokens", "12", "--answer-tokens", "8"])
    levels = out["levels"]
    assert len(levels) == depth
    parents = {None: None}
    prev_kept = {0}
    for lvl in levels:
        assert len(lvl) == len(prev_kept) * branch
        assert {n["parent"] for n in lvl} == prev_kept  # only kept branches were expanded
        scores = sorted((n["score"] for n in lvl), reverse=True)
        kept = [n for n in lvl if n["kept"]]
        assert len(kept) == keep and sorted((n["score"] for n in kept), reverse=True) == scores[:keep]
        assert all(0.0 <= n["score"] <= 1.0 for n in lvl)
        prev_kept = {n["id"] for n in kept}
        parents.update({n["id"]: n["parent"] for n in lvl})
    last = levels[-1]
    best = max(last, key=lambda n: n["score"])
    assert out["chosen_score"] == best["score"]
    assert out["chosen"] in {n["id"] for n in last if n["score"] == best["score"]}
    assert out["answer"] is not None
