"""The automatic prefix cache on the real model: outputs with it equal outputs without it, token
for token (greedy and seeded sampling), for prompts sharing all, some or none of their full pages."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import Run, wasm_bytes

from host import Host, HostConfig

pytestmark = pytest.mark.build

SYSTEM = ("You are a careful assistant for a small museum of maritime history. Answer in one short "
          "sentence, name the exhibit room when it helps, and never invent opening hours or prices.")
RUNS = [  # (system, question, sampling flags): in this order, so later runs can hit earlier ones
    (SYSTEM, "Where can I see ship models?", []),
    (SYSTEM, "Where can I see ship models?", []),  # the same prompt again: all full pages shared
    (SYSTEM, "Is there a lighthouse lens?", []),  # the same system prompt: some pages shared
    ("Reply with a single word.", "Name a colour.", []),  # nothing shared
    (SYSTEM, "What is the oldest boat here?", ["--temperature", "1.0", "--seed", "7"]),
    (SYSTEM, "What is the oldest boat here?", ["--temperature", "1.0", "--seed", "7"]),
]


def outputs(backend: Any, tmp_path_factory: pytest.TempPathFactory, mode: str) -> tuple[list[str], dict]:
    host = Host(HostConfig(data_dir=tmp_path_factory.mktemp(f"pc-{mode}"), prefix_cache=mode), backend=backend)
    try:
        prog = host.compile(wasm_bytes("text_completion"))
        texts = []
        for system, question, flags in RUNS:
            end = Run(host, prog, ["--system", system, "--prompt", question, "--max-tokens", "20", *flags]).finish(300)
            assert end.event == "completed", end.message
            texts.append(end.message)
        return texts, host.stats()["prefix_cache"]
    finally:
        host.shutdown()


def test_outputs_with_the_cache_equal_outputs_without_it(backend, tmp_path_factory) -> None:  # noqa: ANN001
    off, off_stats = outputs(backend, tmp_path_factory, "off")
    on, on_stats = outputs(backend, tmp_path_factory, "per-client")
    assert on == off
    assert off_stats == {"mode": "off"}
    # runs 2, 3, 5 and 6 reuse the system prompt's full pages (run 2 and 6: every full page)
    assert on_stats["hits"] >= 4 and on_stats["tokens_saved"] >= 4 * 32
    assert on_stats["entries"] > 0
