"""Load on the OpenAI endpoint: requests/s, time to first token and time per output token at 1/16/64
concurrent streaming clients, and the same inferlet through the WebSocket protocol in the same run;
then a tool-call request mix and Responses streams (issue 39), against plain chat in the same run.

Starts the real host (default model) and a server in this process with the standard handler
(inferlets/openai_chat) on its one port. For each client count, that many clients (in a child
process, so they do not share the server's GIL) each send `--requests-per-client` streaming chat
requests one after another:
  openai     POST /v1/chat/completions with "stream": true (SSE chunks, parsed as they arrive);
  websocket  the same handler program launched over protocol v1 with the very same JSON request
             argument the HTTP route builds; its {"delta"} messages streamed back as events;
  tools      the chat requests, every other one with a function tool and tool_choice "required"
             (its call drawn under the tools' grammar; the call's deltas come once it is complete, so
             for those TTFT is the call's latency);
  responses  POST /v1/responses with "stream": true, the same prompts (response.output_text.delta
             events; tokens from the terminal event's usage).
Time to first token (TTFT) is from sending the request to the first non-empty text piece; time per
output token (TPOT) is (last piece - first piece) / (completion tokens - 1) per request, the
completion tokens from the handler's usage. Greedy, fixed prompts: both paths generate the same text.
A warm-up at the largest client count first (so neither path pays for the first start of that many
instances), each level measured once the host has settled (warm pool refilled, finished stores freed),
and the two paths alternate which goes first at each level.

    python bench/openai_load.py --json bench/openai_load.json [--md bench/openai_load.md] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import percentile, settle

from host import Host, HostConfig
from host.cli.build import resolve_inferlet
from host.server import Server, ServerConfig
from host.server.openai_request import parse_request

PROMPTS = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.",
           "What is 2 + 2?", "Give me a fruit.", "What is water made of?"]
MODES = ("openai", "websocket", "tools", "responses")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 16},
                                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                                               "required": ["city", "unit"]}}}]


@dataclass
class Sample:
    ttft_s: float
    latency_s: float
    tpot_s: float | None  # None with fewer than two tokens
    tokens: int


def _body(model: str, i: int, max_tokens: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def _sample(t0: float, first: float | None, last: float, tokens: int) -> Sample:
    if first is None:
        raise RuntimeError("no token came back")
    tpot = (last - first) / (tokens - 1) if tokens > 1 else None
    return Sample(first - t0, time.perf_counter() - t0, tpot, tokens)


def _http_request(mode: str, model: str, i: int, max_tokens: int) -> tuple[str, dict[str, Any]]:
    """The route and body of request `i` of an HTTP mode (openai, tools, responses)."""
    if mode == "responses":
        return "/v1/responses", {"model": model, "input": PROMPTS[i % len(PROMPTS)], "max_output_tokens": max_tokens,
                                 "temperature": 0, "stream": True}
    body = _body(model, i, max_tokens)
    if mode == "tools" and i % 2 == 0:
        body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    return "/v1/chat/completions", body


def _piece(mode: str, event: dict[str, Any]) -> tuple[bool, int | None]:
    """Whether an SSE event carries output (text or a tool call's part), and the completion tokens if it says."""
    if mode == "responses":
        kind = event.get("type", "")
        if kind in ("response.completed", "response.incomplete"):
            return False, event["response"]["usage"]["output_tokens"]
        return kind == "response.output_text.delta" and bool(event.get("delta")), None
    tokens = event["usage"]["completion_tokens"] if event.get("usage") else None
    return any(c["delta"].get("content") or c["delta"].get("tool_calls") for c in event["choices"]), tokens


async def _openai_client(base: str, model: str, index: int, rounds: int, max_tokens: int,
                         mode: str = "openai") -> list[Sample]:
    import httpx

    samples = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as http:
        for r in range(rounds):
            route, body = _http_request(mode, model, index + r, max_tokens)
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            async with http.stream("POST", route, json=body) as resp:
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()}")
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    output, said = _piece(mode, json.loads(line[6:]))
                    tokens = said if said is not None else tokens
                    if output:
                        last = time.perf_counter()
                        first = first or last
            samples.append(_sample(t0, first, last or t0, tokens))
    return samples


async def _ws_client(url: str, program: str, model: str, index: int, rounds: int, max_tokens: int) -> list[Sample]:
    from host.client import PieClient

    samples = []
    async with await PieClient.connect(url) as client:
        for r in range(rounds):
            req = parse_request(json.dumps(_body(model, index + r, max_tokens)).encode(), True, 4096)
            t0 = time.perf_counter()
            iid = await client.launch(program, [json.dumps(dataclasses.asdict(req))])
            first = last = None
            tokens = 0
            async for event in client.events(iid):
                if event.terminal:
                    if event.event != "completed":
                        raise RuntimeError(f"request failed: {event.event}: {event.message}")
                    break
                msg = json.loads(event.message)
                if msg.get("delta"):
                    last = time.perf_counter()
                    first = first or last
                elif "usage" in msg:
                    tokens = msg["usage"]["completion_tokens"]
            samples.append(_sample(t0, first, last or t0, tokens))
    return samples


def _drive(mode: str, server: dict[str, str], clients: int, rounds: int, max_tokens: int,
           ) -> tuple[list[Sample], float]:
    async def main() -> list[list[Sample]]:
        if mode != "websocket":
            jobs = [_openai_client(server["http"], server["model"], i, rounds, max_tokens, mode)
                    for i in range(clients)]
        else:
            jobs = [_ws_client(server["ws"], server["program"], server["model"], i, rounds, max_tokens)
                    for i in range(clients)]
        return await asyncio.gather(*jobs)

    t0 = time.perf_counter()
    results = asyncio.run(main())
    return [s for per_client in results for s in per_client], time.perf_counter() - t0


def run_level(pool: ProcessPoolExecutor, mode: str, server: dict[str, str], clients: int, rounds: int,
              max_tokens: int) -> tuple[list[Sample], float]:
    """The clients run in a child process, as real clients would: they do not share the server's GIL."""
    return pool.submit(_drive, mode, server, clients, rounds, max_tokens).result()


def summarize(samples: list[Sample], wall_s: float) -> dict[str, float]:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [s.tpot_s * 1000 for s in samples if s.tpot_s is not None]
    lat = [s.latency_s * 1000 for s in samples]
    tokens = sum(s.tokens for s in samples)
    return {"requests": len(samples), "wall_s": round(wall_s, 3),
            "throughput_req_s": round(len(samples) / wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2),
            "ttft_p50_ms": round(statistics.median(ttft), 1), "ttft_p99_ms": round(percentile(ttft, 0.99), 1),
            "tpot_p50_ms": round(statistics.median(tpot), 1) if tpot else None,
            "tpot_p99_ms": round(percentile(tpot, 0.99), 1) if tpot else None,
            "latency_p50_ms": round(statistics.median(lat), 1), "latency_p99_ms": round(percentile(lat, 0.99), 1)}


def markdown(result: dict[str, Any], levels: list[int]) -> str:
    head = ("| clients | path | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | "
            "latency p50 ms |\n|---|---|---|---|---|---|---|---|---|\n")
    rows = []
    for n in levels:
        for mode in result["meta"]["modes"]:
            r = result[mode].get(str(n))
            if r:
                rows.append(f"| {n} | {mode} | {r['throughput_req_s']} | {r['tokens_per_s']} | {r['ttft_p50_ms']} | "
                            f"{r['ttft_p99_ms']} | {r['tpot_p50_ms']} | {r['tpot_p99_ms']} | {r['latency_p50_ms']} |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write results here")
    ap.add_argument("--md", type=Path, help="also write a markdown table here (default: next to --json)")
    ap.add_argument("--clients", default="1,16,64", help="comma-separated client counts (default 1,16,64)")
    ap.add_argument("--requests-per-client", type=int, default=4, help="sequential requests per client (4)")
    ap.add_argument("--max-tokens", type=int, default=16, help="max tokens per request (16)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the host's choice)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated paths to measure (default {','.join(MODES)})")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 1 and 2 clients, 1 request each, 4 tokens")
    opts = ap.parse_args(argv)
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(clients="1,2", requests_per_client=1, max_tokens=4)
        opts = ap.parse_args(argv)
    levels = [int(x) for x in opts.clients.split(",")]
    modes = tuple(m for m in opts.modes.split(",") if m)
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes: choose from {', '.join(MODES)}")

    wasm = resolve_inferlet("openai_chat", quiet=True).read_bytes()
    data_dir = Path(tempfile.mkdtemp(prefix="pie-bench-"))
    host = Host(HostConfig(data_dir=data_dir, device=opts.device), progress=False)
    program = host.compile(wasm)
    server = Server(host, ServerConfig(port=0, data_dir=data_dir), openai_program=program)
    server.start_background()
    assert asyncio.run(_upload(server.url, wasm)) == program  # protocol v1 runs programs from its store
    info = {"http": server.http_url, "ws": server.url, "model": host.model_name, "program": program}
    result: dict[str, Any] = {mode: {} for mode in modes}
    try:
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            for mode in modes:  # warm-up at the largest level: the child, the instance pool's slots
                run_level(pool, mode, info, max(levels), 1, 2)
            for k, n in enumerate(levels):
                for mode in modes if k % 2 == 0 else modes[::-1]:  # neither path always goes first
                    settle(host, program, max(levels))
                    start_free = host.free_pages()
                    samples, wall = run_level(pool, mode, info, n, opts.requests_per_client, opts.max_tokens)
                    result[mode][str(n)] = summarize(samples, wall)
                    result[mode][str(n)]["pages_leaked"] = start_free - host.free_pages()
                    print(f"{mode:9s} {n:3d} clients: {result[mode][str(n)]}", flush=True)
    finally:
        server.stop_background()
        host.shutdown()
    result["meta"] = {"model": host.model_name, "modes": list(modes), "device": getattr(host.backend.info, "device", "?"),
                      "max_tokens": opts.max_tokens, "requests_per_client": opts.requests_per_client,
                      "policy": host.config.policy, "python": platform.python_version(),
                      "machine": platform.machine(), "cpus": multiprocessing.cpu_count(),
                      "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result, levels)
    print(table)
    (opts.md or opts.json.with_suffix(".md")).write_text(table)
    return 0


async def _upload(url: str, wasm: bytes) -> str:
    from host.client import PieClient

    async with await PieClient.connect(url) as client:
        return await client.ensure_program(wasm)


if __name__ == "__main__":
    sys.exit(main())
