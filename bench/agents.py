"""ReAct agents: KV kept across turns (ours) vs a stateless-completion-API baseline, same backend.

Each agent is the `agent_react` inferlet doing --turns tool calls to a client-side tool that answers
after --tool-ms (50 ms), then a final answer. Ours keeps the transcript's KV for the whole run; the
baseline (`--stateless`) re-sends and re-prefills the whole transcript every turn, like a stateless
completion API. Both run on the same embedded host (same backend, same batching scheduler), with 1
and 16 agents at once.

    python bench/agents.py --json bench/agents.json

Writes {"throughput_ratio": {"1": .., "16": ..}, "latency_ratio": {"1": .., "16": ..},
"prefill_tokens_per_agent": {"ours": .., "baseline": ..}} plus the raw runs under "runs", and
prints a markdown table. Throughput ratio is ours / baseline (agents per second); latency ratio
is baseline / ours (mean end-to-end seconds per agent).
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
            "turns_per_agent": statistics.mean(len(o["turns"]) for o in outs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--tool-ms", type=float, default=50.0)
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--thought-tokens", type=int, default=12)
    ap.add_argument("--device", default=None)
    a = ap.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    host = Host(HostConfig(device=a.device, num_pages=4096, kv_memory_bytes=None), progress=False)
    try:
        prog = host.compile(resolve_inferlet("agent_react", quiet=True).read_bytes())
        common = ["--tool-choice", "ask_user", "--max-turns", str(a.turns), "--thought-tokens", str(a.thought_tokens),
                  "--arg-tokens", "8", "--answer-tokens", "8", "--client-timeout-ms", "600000", "--json"]
        run_agents(host, prog, 1, common, a.tool_ms)  # warm-up (instantiation, torch kernels)
        runs: dict[str, dict[str, dict]] = {"ours": {}, "baseline": {}}
        for n in levels:
            for name, extra in (("ours", []), ("baseline", ["--stateless"])):
                r = run_agents(host, prog, n, common + extra, a.tool_ms)
                runs[name][str(n)] = r
                print(f"{name:8s} n={n:3d} wall {r['wall_s']:.2f}s latency {r['mean_latency_s']:.2f}s "
                      f"prefill/agent {r['prefill_tokens_per_agent']:.0f}", file=sys.stderr)
    finally:
        host.shutdown()
    result = {
        "throughput_ratio": {k: runs["ours"][k]["throughput_agents_per_s"] / runs["baseline"][k]["throughput_agents_per_s"]
                             for k in runs["ours"]},
        "latency_ratio": {k: runs["baseline"][k]["mean_latency_s"] / runs["ours"][k]["mean_latency_s"] for k in runs["ours"]},
        "prefill_tokens_per_agent": {name: runs[name][str(levels[-1])]["prefill_tokens_per_agent"] for name in runs},
        "runs": runs,
        "config": {"turns": a.turns, "tool_ms": a.tool_ms, "thought_tokens": a.thought_tokens,
                   "device": str(host.backend.model.device), "model": host.model_name},
    }
    print("| agents | ours agents/s | baseline agents/s | throughput x | ours latency s | baseline latency s | latency x |")
    print("|---|---|---|---|---|---|---|")
    for k in runs["ours"]:
        o, b = runs["ours"][k], runs["baseline"][k]
        print(f"| {k} | {o['throughput_agents_per_s']:.3f} | {b['throughput_agents_per_s']:.3f} | "
              f"{result['throughput_ratio'][k]:.2f} | {o['mean_latency_s']:.2f} | {b['mean_latency_s']:.2f} | "
              f"{result['latency_ratio'][k]:.2f} |")
    print(f"prefilled tokens per agent: ours {result['prefill_tokens_per_agent']['ours']:.0f}, "
          f"baseline {result['prefill_tokens_per_agent']['baseline']:.0f}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
