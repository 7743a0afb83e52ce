"""Load on `pie-serve`: throughput and latency of short text_completion requests at 1/16/64 clients.

Starts the real host (default model) and a server in this process, then for each client count
runs that many WebSocket clients (in a child process, so they do not share the server's GIL),
each sending `--requests-per-client` requests one after another
(`text_completion --max-tokens N --stream`). Time to first message (TTFM) is from sending the
launch to the first streamed piece; latency is from the launch to `completed`. The baseline runs
the same requests on the same host without the server (direct `Host.launch` from threads), so the
difference is the cost of the WebSocket layer.

    python bench/server_load.py --json out/server_load.json [--md out/server_load.md] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import percentile

from host import Host, HostConfig
from host.cli.build import resolve_inferlet
from host.client import PieClient
from host.server import Server, ServerConfig

PROMPTS = ["What is the capital of France?", "Name three colours.", "Say hello in Spanish.",
           "What is 2 + 2?", "Give me a fruit.", "What is water made of?"]


@dataclass
class Sample:
    ttfm_s: float
    latency_s: float
    text: str


def _args(i: int, max_tokens: int) -> list[str]:
    return ["--prompt", PROMPTS[i % len(PROMPTS)], "--max-tokens", str(max_tokens), "--stream"]


async def _client(url: str, program: str, index: int, rounds: int, max_tokens: int) -> list[Sample]:
    samples = []
    async with await PieClient.connect(url) as client:
        for r in range(rounds):
            t0 = time.perf_counter()
            iid = await client.launch(program, _args(index + r, max_tokens))
            first = None
            async for event in client.events(iid):
                if first is None:
                    first = time.perf_counter()
                if event.terminal:
                    if event.event != "completed":
                        raise RuntimeError(f"request failed: {event.event}: {event.message}")
                    samples.append(Sample(first - t0, time.perf_counter() - t0, event.message))
    return samples


def _drive_clients(url: str, program: str, clients: int, rounds: int, max_tokens: int) -> tuple[list[Sample], float]:
    async def main() -> list[list[Sample]]:
        return await asyncio.gather(*(_client(url, program, i, rounds, max_tokens) for i in range(clients)))

    t0 = time.perf_counter()
    results = asyncio.run(main())
    return [s for per_client in results for s in per_client], time.perf_counter() - t0


def run_server_level(url: str, program: str, clients: int, rounds: int, max_tokens: int) -> tuple[list[Sample], float]:
    """The clients run in a child process, as real clients would: they do not share the server's GIL."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_drive_clients, url, program, clients, rounds, max_tokens).result()


def run_direct_level(host: Host, program: str, clients: int, rounds: int, max_tokens: int) -> tuple[list[Sample], float]:
    samples: list[Sample] = []
    lock = threading.Lock()

    def worker(index: int) -> None:
        for r in range(rounds):
            events: queue.Queue[Any] = queue.Queue()
            t0 = time.perf_counter()
            host.launch(program, _args(index + r, max_tokens), events.put)
            first = None
            while True:
                ev = events.get(timeout=600)
                if first is None:
                    first = time.perf_counter()
                if ev.event != "message":
                    break
            if ev.event != "completed":
                raise RuntimeError(f"request failed: {ev.event}: {ev.message}")
            with lock:
                samples.append(Sample(first - t0, time.perf_counter() - t0, ev.message))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return samples, time.perf_counter() - t0


def summarize(samples: list[Sample], wall_s: float, count_tokens: Callable[[str], int]) -> dict[str, float]:
    tokens = sum(count_tokens(s.text) for s in samples)
    ttfm = [s.ttfm_s * 1000 for s in samples]
    lat = [s.latency_s * 1000 for s in samples]
    return {"requests": len(samples), "wall_s": round(wall_s, 3),
            "throughput_req_s": round(len(samples) / wall_s, 3), "tokens_per_s": round(tokens / wall_s, 2),
            "ttfm_p50_ms": round(statistics.median(ttfm), 1), "ttfm_p99_ms": round(percentile(ttfm, 0.99), 1),
            "latency_p50_ms": round(statistics.median(lat), 1), "latency_p99_ms": round(percentile(lat, 0.99), 1)}


def markdown(result: dict[str, Any], levels: list[int]) -> str:
    head = ("| clients | mode | req/s | tokens/s | TTFM p50 ms | TTFM p99 ms | latency p50 ms | latency p99 ms |\n"
            "|---|---|---|---|---|---|---|---|\n")
    rows = []
    for n in levels:
        for mode, table in (("server", result), ("direct (baseline)", result.get("baseline", {}))):
            r = table.get(str(n))
            if r:
                rows.append(f"| {n} | {mode} | {r['throughput_req_s']} | {r['tokens_per_s']} | {r['ttfm_p50_ms']} | "
                            f"{r['ttfm_p99_ms']} | {r['latency_p50_ms']} | {r['latency_p99_ms']} |")
    return head + "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="write results here")
    ap.add_argument("--md", type=Path, help="also write a markdown table here")
    ap.add_argument("--clients", default="1,16,64", help="comma-separated client counts (default 1,16,64)")
    ap.add_argument("--requests-per-client", type=int, default=3, help="sequential requests per client (3)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per request (8)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the direct-host baseline")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the host's choice)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 1 and 2 clients, 1 request each, 4 tokens")
    opts = ap.parse_args(argv)
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(clients="1,2", requests_per_client=1, max_tokens=4)
        opts = ap.parse_args(argv)
    levels = [int(x) for x in opts.clients.split(",")]

    wasm = resolve_inferlet("text_completion", quiet=True).read_bytes()
    data_dir = Path(tempfile.mkdtemp(prefix="pie-bench-"))
    host = Host(HostConfig(data_dir=data_dir, device=opts.device), progress=False)
    tokenizer = host.backend.tokenizer
    count = (lambda text: len(tokenizer.encode(text)))  # noqa: E731
    server = Server(host, ServerConfig(port=0, data_dir=data_dir))
    server.start_background()
    result: dict[str, Any] = {}
    baseline: dict[str, Any] = {}
    try:
        program = asyncio.run(_upload(server.url, wasm))
        run_server_level(server.url, program, 2, 1, opts.max_tokens)  # warm-up
        for n in levels:
            start_free = host.free_pages()
            samples, wall = run_server_level(server.url, program, n, opts.requests_per_client, opts.max_tokens)
            result[str(n)] = summarize(samples, wall, count)
            result[str(n)]["pages_leaked"] = start_free - host.free_pages()
            print(f"server  {n:3d} clients: {result[str(n)]}", flush=True)
            if not opts.no_baseline:
                samples, wall = run_direct_level(host, program, n, opts.requests_per_client, opts.max_tokens)
                baseline[str(n)] = summarize(samples, wall, count)
                print(f"direct  {n:3d} clients: {baseline[str(n)]}", flush=True)
    finally:
        server.stop_background()
        host.shutdown()
    if baseline:
        result["baseline"] = baseline
    result["meta"] = {"model": host.model_name, "device": getattr(host.backend.info, "device", "?"),
                      "max_tokens": opts.max_tokens, "requests_per_client": opts.requests_per_client,
                      "policy": host.config.policy, "python": platform.python_version(),
                      "machine": platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result, levels)
    print(table)
    if opts.md:
        opts.md.write_text(table)
    return 0


async def _upload(url: str, wasm: bytes) -> str:
    async with await PieClient.connect(url) as client:
        return await client.ensure_program(wasm)


if __name__ == "__main__":
    sys.exit(main())
