"""The automatic prefix cache: 16 requests sharing a long system prompt, with and without the cache.

Usage: python bench/prefix_cache.py --json OUT [--requests 16] [--system-tokens 1000] [--max-tokens 8] [--quick]

The same 16 `text_completion` requests (one shared system prompt of about --system-tokens tokens,
a different question each, greedy, streamed) are launched at once on the embedded host with the
real default model, first with `prefix_cache="off"` then `"per-client"` (same backend, same
run). Reports the tokens the backend prefilled (batch tokens minus one per decode step) and the
time to first token (launch -> first streamed text), and checks the outputs are the same.
JSON: {"prefilled_tokens": {"off": .., "on": ..}, "ttft_ms_p50": {"off": .., "on": ..}, ...}.
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import time
from pathlib import Path
from typing import Any

from host import Host, HostConfig, InstanceEvent
from host.cli.build import resolve_inferlet

QUESTIONS = ["Where are the ship models?", "Is there a lighthouse lens?", "What is the oldest boat?",
             "Can children join a tour?", "Where is the map room?", "Who built the big anchor?",
             "Is photography allowed?", "Where can I buy a postcard?", "What is in room 4?",
             "Is there a sailor's diary?", "Where are the knots shown?", "What does the compass show?",
             "Is there a submarine?", "Where is the cafe?", "What is a sextant?", "Who was the first captain?"]


def system_prompt(host: Host, tokens: int) -> str:
    """A museum guide's instructions, repeated until about `tokens` tokens."""
    unit = ("You are the guide of a small museum of maritime history. Rooms hold ship models, charts, "
            "navigation tools, diaries and photographs of the harbour. Answer briefly and kindly. ")
    text = unit
    while len(host.backend.tokenizer.encode(text)) < tokens:
        text += unit
    return text


def run_requests(host: Host, prog: str, system: str, n: int, max_tokens: int) -> dict[str, Any]:
    events: queue.Queue[InstanceEvent] = queue.Queue()
    before = host.scheduler.stats.as_dict()
    starts, first, texts = {}, {}, {}
    for i in range(n):
        t = time.perf_counter()
        iid = host.launch(prog, ["--system", system, "--prompt", QUESTIONS[i % len(QUESTIONS)],
                                 "--max-tokens", str(max_tokens), "--stream"], events.put)
        starts[iid] = t
    while len(texts) < n:
        ev = events.get(timeout=600)
        if ev.event == "message":
            first.setdefault(ev.instance_id, time.perf_counter())
        elif ev.terminal:
            if ev.event != "completed":
                raise RuntimeError(f"{ev.event}: {ev.message}")
            texts[ev.instance_id] = ev.message
    after = host.scheduler.stats.as_dict()
    decode_steps = n * (max_tokens - 1)  # each request's first token comes with its prefill
    return {"prefilled_tokens": after["tokens"] - before["tokens"] - decode_steps,
            "ttft_ms_p50": 1000 * statistics.median(first[i] - starts[i] for i in starts),
            "texts": [texts[i] for i in starts]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 4 requests, a 64-token system prompt, 4 tokens each")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(requests=4, system_tokens=64, max_tokens=4)
        opts = ap.parse_args()
    backend = None
    res: dict[str, Any] = {"prefilled_tokens": {}, "ttft_ms_p50": {}}
    outputs = {}
    for label, mode in (("off", "off"), ("on", "per-client")):
        host = Host(HostConfig(prefix_cache=mode, num_pages=4096, kv_memory_bytes=None), backend=backend,
                    progress=False)
        backend = host.backend
        prog = host.compile(resolve_inferlet("text_completion", quiet=True).read_bytes())
        system = system_prompt(host, opts.system_tokens)
        run_requests(host, prog, "warm-up", 1, 2)
        r = run_requests(host, prog, system, opts.requests, opts.max_tokens)
        res["prefilled_tokens"][label] = r["prefilled_tokens"]
        res["ttft_ms_p50"][label] = round(r["ttft_ms_p50"], 1)
        outputs[label] = r["texts"]
        res[f"prefix_cache_{label}"] = host.stats()["prefix_cache"]
        host.shutdown()
    res["same_outputs"] = outputs["on"] == outputs["off"]
    res["prefill_ratio"] = round(res["prefilled_tokens"]["off"] / max(res["prefilled_tokens"]["on"], 1), 2)
    res["ttft_ratio"] = round(res["ttft_ms_p50"]["off"] / res["ttft_ms_p50"]["on"], 2)
    res["config"] = {"requests": opts.requests, "system_tokens": opts.system_tokens, "max_tokens": opts.max_tokens,
                     "model": backend.info.name if backend is not None else None}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    if not res["same_outputs"]:
        raise SystemExit("outputs differ with and without the prefix cache")


if __name__ == "__main__":
    main()
