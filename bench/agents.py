"""ReAct agents: KV kept across turns (ours) vs stateless-completion-API baselines, same backend.

Each agent is the `agent_react` inferlet doing --turns tool calls to a client-side tool that answers
after --tool-ms (50 ms), then a final answer. Ours keeps the transcript's KV for the whole run; the
baselines (`--stateless`) re-send the whole transcript every turn, like a stateless completion API:
`baseline` with the host's prefix cache off (every turn re-prefills everything), `baseline_cached`
with it on (what vLLM with automatic prefix caching does: only the new suffix is prefilled). All
run on the same backend and batching scheduler, with 1 and 16 agents at once; ours runs with the
prefix cache on, as the host does by default.

    python bench/agents.py --json bench/agents.json [--quick]

Writes {"throughput_ratio": {"1": .., "16": ..}, "latency_ratio": {...}} against `baseline`, the
same against `baseline_cached` ("throughput_ratio_cached", "latency_ratio_cached"),
"prefill_tokens_per_agent" (tokens the inferlet filled) and "backend_tokens_per_agent" (tokens the
backend actually ran, prefix-cache hits excluded) per variant, plus the raw runs under "runs".
Throughput ratio is ours / baseline (agents per second); latency ratio is baseline / ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

from host import Host, HostConfig
from host.cli.build import resolve_inferlet
from host.events import TERMINAL_EVENTS


def run_agents(host: Host, prog: str, n: int, args: list[str], tool_ms: float) -> dict:
    """Launch n agents at once; answer each client tool call after tool_ms; wait for all."""
    done = threading.Event()
    lock = threading.Lock()
    ends: dict[str, tuple[float, str, str]] = {}
    starts: dict[str, float] = {}
    ids: list[str] = []

    def on_event(ev) -> None:
        if ev.event in TERMINAL_EVENTS:
            with lock:
                ends[ev.instance_id] = (time.perf_counter(), ev.event, ev.message)
                if len(ends) == n:
                    done.set()
            return
        msg = json.loads(ev.message) if ev.message.startswith("{") else {}
        if msg.get("type") == "tool_call":
            reply = f"answer to turn {msg['turn']}: ok"
            threading.Timer(tool_ms / 1000, host.signal, (ev.instance_id, reply)).start()

    tokens0 = host.scheduler.stats.tokens
    t0 = time.perf_counter()
    for _ in range(n):
        launched = time.perf_counter()
        iid = host.launch(prog, args, on_event)
        starts[iid] = launched
        ids.append(iid)
    if not done.wait(1800):
        raise RuntimeError("agents did not finish in 30 minutes")
    wall = time.perf_counter() - t0
    bad = [m for _t, e, m in ends.values() if e != "completed"]
    if bad:
        raise RuntimeError(f"{len(bad)} agents failed: {bad[0][:2000]}")
    outs = [json.loads(m) for _t, _e, m in ends.values()]
    lat = [ends[i][0] - starts[i] for i in ids]
    return {"agents": n, "wall_s": wall, "throughput_agents_per_s": n / wall, "mean_latency_s": statistics.mean(lat),
            "prefill_tokens_per_agent": statistics.mean(o["prefill_tokens"] for o in outs),
            "backend_tokens_per_agent": (host.scheduler.stats.tokens - tokens0) / n,
            "turns_per_agent": statistics.mean(len(o["turns"]) for o in outs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--thought-tokens", type=int, default=12)
    ap.add_argument("--device", default=None)
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 1 turn, 2 thought tokens, 1 ms tools, 1 agent")
    a = ap.parse_args(argv)
    if a.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(turns=1, tool_ms=1.0, concurrency="1", thought_tokens=2)
        a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    common = ["--tool-choice", "ask_user", "--max-turns", str(a.turns), "--thought-tokens", str(a.thought_tokens),
              "--arg-tokens", "8", "--answer-tokens", "8", "--client-timeout-ms", "600000", "--json"]
    variants = {"off": [("baseline", ["--stateless"])],
                "per-client": [("ours", []), ("baseline_cached", ["--stateless"])]}
    runs: dict[str, dict[str, dict]] = {"ours": {}, "baseline": {}, "baseline_cached": {}}
    backend = None
    for mode, names in variants.items():  # one host at a time on the one backend
        host = Host(HostConfig(device=a.device, num_pages=4096, kv_memory_bytes=None, prefix_cache=mode),
                    backend=backend, progress=False)
        backend = host.backend
        try:
            prog = host.compile(resolve_inferlet("agent_react", quiet=True).read_bytes())
            run_agents(host, prog, 1, common, a.tool_ms)  # warm-up (instantiation, torch kernels)
            for n in levels:
                for name, extra in names:
                    r = run_agents(host, prog, n, common + extra, a.tool_ms)
                    runs[name][str(n)] = r
                    print(f"{name:15s} n={n:3d} wall {r['wall_s']:.2f}s latency {r['mean_latency_s']:.2f}s "
                          f"backend tokens/agent {r['backend_tokens_per_agent']:.0f}", file=sys.stderr)
            model = host.model_name
        finally:
            host.shutdown()
    def ratio(base: str, key: str, ours_over_base: bool) -> dict[str, float]:
        return {k: (runs["ours"][k][key] / runs[base][k][key]) if ours_over_base
                else (runs[base][k][key] / runs["ours"][k][key]) for k in runs["ours"]}

    result = {
        "throughput_ratio": ratio("baseline", "throughput_agents_per_s", True),
        "latency_ratio": ratio("baseline", "mean_latency_s", False),
        "throughput_ratio_cached": ratio("baseline_cached", "throughput_agents_per_s", True),
        "latency_ratio_cached": ratio("baseline_cached", "mean_latency_s", False),
        "prefill_tokens_per_agent": {name: runs[name][str(levels[-1])]["prefill_tokens_per_agent"] for name in runs},
        "backend_tokens_per_agent": {name: runs[name][str(levels[-1])]["backend_tokens_per_agent"] for name in runs},
        "runs": runs,
        "config": {"turns": a.turns, "tool_ms": a.tool_ms, "thought_tokens": a.thought_tokens,
                   "device": a.device or "default", "model": model},
    }
    print("| agents | baseline | ours agents/s | baseline agents/s | throughput x | ours latency s | "
          "baseline latency s | latency x |")
    print("|---|---|---|---|---|---|---|---|")
    for base, sfx in (("baseline", ""), ("baseline_cached", "_cached")):
        for k in runs["ours"]:
            o, b = runs["ours"][k], runs[base][k]
            print(f"| {k} | {base} | {o['throughput_agents_per_s']:.3f} | {b['throughput_agents_per_s']:.3f} | "
                  f"{result['throughput_ratio' + sfx][k]:.2f} | {o['mean_latency_s']:.2f} | "
                  f"{b['mean_latency_s']:.2f} | {result['latency_ratio' + sfx][k]:.2f} |")
    print("backend tokens per agent: " + ", ".join(f"{n} {v:.0f}" for n, v in result["backend_tokens_per_agent"].items()))
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
