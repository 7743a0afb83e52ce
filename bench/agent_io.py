"""The I/O dividend of agents as inferlets: the same agent run server-side (an inferlet doing its
own I/O) and client-driven over the OpenAI endpoint, on one host, model and run.

Three agent kinds, each a fixed loop (bench/inferlets/agent_io: `--ios` steps of `--tokens` greedy
tokens, each followed by an I/O whose result is the next user message, then a final answer):
  react    the I/O is a GET on a local tool HTTP server that answers after `--tool-ms`;
  codeact  the I/O is running a small Python snippet (in the inferlet's sandbox / in the client);
  swarm    the I/O is a message to a peer agent, who answers with `--tokens` tokens from its own chat.
Each is done two ways, with the same prompts, snippet, tool URL and token budget:
  inferlet  one instance of bench/inferlets/agent_io per agent, launched over the WebSocket
            protocol: the transcript's KV stays in the instance, the tool is fetched by the host
            (`inferlet.http`), the snippet runs in the guest, the peer is a child instance;
  client    an OpenAI-client agent (the `openai` package, as an OpenAI Agents SDK app would run):
            each step POSTs the whole transcript to /v1/chat/completions (max_tokens T,
            temperature 0; the host's prefix cache on, its default), runs the I/O itself (GETs
            the tool server, execs the snippet, or drives the peer's conversation through the same
            endpoint) and appends the result.
Every agent has its own case (a line of its task, and its tool queries): agents share the system
prompt's KV, as real ones do, but not their transcripts. Both ways' clients run in one child
process (as real clients would: not on the server's GIL); the host, its server and the tool server
run in this process. Measured per kind x ios x tool_ms x
agents: each agent's end-to-end latency (launch or first request -> final answer) and agents per
second (agents / the burst's wall time, all `--agents` started at once), each cell `--repeats`
times (medians), the two ways alternating which goes first. latency_ratio = client / inferlet
(> 1: the inferlet is faster), throughput_ratio = inferlet / client. `--tool-ms` applies to react
only (the one kind with a web tool): codeact and swarm run at tool_ms 0. Also per way: the I/Os
each agent did (`ios_done`, must equal --ios), tokens generated, and tokens the backend ran per agent
(prefill + decode, prefix-cache hits excluded: what re-sending the transcript costs).

Target (issue): at 8 I/Os, latency_ratio >= 1.15 (at 1 agent) and throughput_ratio >= 1.3 (at the
largest agent count), growing with the I/O count.

    python bench/agent_io.py --json bench/agent_io.json [--quick]
    python bench/agent_io.py --stand-in --json bench/agent_io_standin.json   # a GPU's step, no model

`--stand-in` runs the same sweep behind the stand-in backend (`--step-ms` per batch, `--token-us`
per new token): where the model's time is small, as on a GPU, and the two ways differ by what the
host and the client do around it. The default is the real model on this machine's device.

Defaults: --kinds react,codeact,swarm --ios 2 8 32 --tool-ms 0 50 --agents 1 8 --tokens 8
--repeats 2 --kv-mib 1024. T = 8 tokens per generation is small on purpose (the run's length), and it
favours the inferlet: the per-turn overheads it saves weigh more against short generations. The full
run took 62 minutes on the 2-core CPU VM (bench/agent_io.md), most of it the 32-I/O, 8-agent cells;
`--ios 2 8` or `--repeats 1` shorten it. The JSON is rewritten after every cell; `--resume` runs only
the cells an interrupted run of the same sweep did not finish.
`--steps` also records each burst's backend batches (how many, how many carry prefill, their tokens and
time, chunked prefills; `--batch-list`: every batch), and `--prefill-chunk auto|N` sets the host's (both
ways run under it): what explained the inferlet way's loss at 8 agents on the CPU (bench/agent_io.md).
`--quick` (CI): every kind at ios 2, 4 tokens, agents 1 and 2, tool-ms 0, 1 repeat, no warm-up
(~45 s; its numbers are not measurements).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import logging
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import parse_qs, urlsplit

from common import ROOT, settle

from gpu_backend.standin import StandInBackend
from host import Host, HostConfig
from host.cli.build import resolve_inferlet
from host.server import Server, ServerConfig

AGENT_DIR = ROOT / "bench" / "inferlets" / "agent_io"
KINDS = ("react", "codeact", "swarm")
WAYS = ("inferlet", "client")
TARGET_IOS, TARGET_LATENCY, TARGET_THROUGHPUT = 8, 1.15, 1.3


# ---- the agent's script (prompts, snippet, messages): the inferlet's own module ---------------------

_SCRIPT: ModuleType | None = None


def script() -> ModuleType:
    """bench/inferlets/agent_io/app.py, imported here (the SDK imports in plain CPython) so that the
    client way sends the very prompts, snippet and observation text the inferlet uses."""
    global _SCRIPT
    if _SCRIPT is None:
        if str(ROOT / "inferlets") not in sys.path:
            sys.path.insert(0, str(ROOT / "inferlets"))
        spec = importlib.util.spec_from_file_location("agent_io_app", AGENT_DIR / "app.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _SCRIPT = module
    return _SCRIPT


# ---- the tool server ------------------------------------------------------------------------------

def tool_text(path: str) -> str:
    """The tool's deterministic answer to `path` (/ms<latency>?q=<step>)."""
    q = parse_qs(urlsplit(path).query).get("q", ["?"])[0]
    return f"found {q}: {sum(map(ord, q)) * 7919 % 100000} people, source city-stats"


class _ToolHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, for clients that keep connections
    # the headers and the body go out in two writes: with Nagle's algorithm on, the body waited for
    # the client's delayed ACK of the headers, ~40 ms on every call of both ways (not a tool latency)
    disable_nagle_algorithm = True

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802
        part = urlsplit(self.path).path.strip("/")
        if part.startswith("ms"):
            time.sleep(float(part[2:]) / 1000)
        body = tool_text(self.path).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def start_tool_server() -> ThreadingHTTPServer:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _ToolHandler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True, name="tool-server").start()
    return srv


# ---- the two ways (run in the client process) -----------------------------------------------------

_LOOP: asyncio.AbstractEventLoop | None = None
_CLIENTS: dict[str, Any] = {}


async def _clients(info: dict[str, str]) -> tuple[Any, Any, Any]:
    """(WebSocket client, OpenAI client, HTTP client), made once per client process and kept, so
    that neither way pays for connecting inside a measured burst."""
    if not _CLIENTS:
        import httpx
        from openai import AsyncOpenAI

        from host.client import PieClient

        _CLIENTS["ws"] = await PieClient.connect(info["ws"])
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        _CLIENTS["openai"] = AsyncOpenAI(base_url=info["http"] + "/v1", api_key="none", max_retries=0,
                                         timeout=900, http_client=httpx.AsyncClient(limits=limits, timeout=900))
        _CLIENTS["http"] = httpx.AsyncClient(limits=limits, timeout=900)
    return _CLIENTS["ws"], _CLIENTS["openai"], _CLIENTS["http"]


async def _inferlet_agent(ws: Any, info: dict[str, str], kind: str, ios: int, tokens: int, tool_url: str,
                          case: str) -> dict[str, Any]:
    t0 = time.perf_counter()
    iid = await ws.launch(info["program"], ["--kind", kind, "--ios", str(ios), "--tokens", str(tokens),
                                            "--case", case, "--tool-url", tool_url])
    async for ev in ws.events(iid):
        if ev.terminal:
            if ev.event != "completed":
                raise RuntimeError(f"agent {kind} failed: {ev.event}: {ev.message[:2000]}")
            out = json.loads(ev.message)
            break
    out["latency_s"] = time.perf_counter() - t0
    return out


async def _client_agent(oa: Any, http: Any, info: dict[str, str], kind: str, ios: int, tokens: int,
                        tool_url: str, case: str) -> dict[str, Any]:
    s = script()

    async def chat(messages: list[dict[str, str]]) -> tuple[str, int]:
        r = await oa.chat.completions.create(model=info["model"], messages=messages, max_tokens=tokens,
                                             temperature=0)
        return r.choices[0].message.content or "", r.usage.completion_tokens

    t0 = time.perf_counter()
    msgs = [{"role": "system", "content": s.SYSTEM[kind]}, {"role": "user", "content": s.task(kind, case)}]
    peer = [{"role": "system", "content": s.PEER_SYSTEM}]
    generated = peer_tokens = done = 0
    for step in range(ios):
        text, n = await chat(msgs)
        generated += n
        msgs.append({"role": "assistant", "content": text})
        if kind == "react":
            r = await http.get(f"{tool_url}?{s.tool_query(case, step)}")
            r.raise_for_status()
            result = r.text
        elif kind == "codeact":
            result = s.run_snippet(s.snippet(step))
        else:
            peer.append({"role": "user", "content": text})
            result, n = await chat(peer)
            peer_tokens += n
            peer.append({"role": "assistant", "content": result})
        done += 1
        msgs.append({"role": "user", "content": s.observation(kind, step, result, step == ios - 1)})
    final, n = await chat(msgs)
    generated += n
    return {"kind": kind, "ios_done": done, "completion_tokens": generated, "peer_tokens": peer_tokens,
            "final": final, "latency_s": time.perf_counter() - t0}


async def _burst(way: str, info: dict[str, str], kind: str, n: int, ios: int, tokens: int, tool_url: str,
                 burst: int) -> dict[str, Any]:
    ws, oa, http = await _clients(info)
    t0 = time.perf_counter()
    if way == "inferlet":
        jobs = [_inferlet_agent(ws, info, kind, ios, tokens, tool_url, f"{burst}.{i}") for i in range(n)]
    else:
        jobs = [_client_agent(oa, http, info, kind, ios, tokens, tool_url, f"{burst}.{i}") for i in range(n)]
    agents = await asyncio.gather(*jobs)
    return {"wall_s": time.perf_counter() - t0, "agents": agents}


def drive(way: str, info: dict[str, str], kind: str, n: int, ios: int, tokens: int, tool_url: str, burst: int,
          ) -> dict[str, Any]:
    """One burst of `n` agents of one way, in the client process (its event loop is kept between
    calls); agent i's case is "<burst>.<i>", so no two agents of a run share a task."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(_burst(way, info, kind, n, ios, tokens, tool_url, burst))


def close_clients() -> None:
    """Close the client process's connections and its event loop (before the pool ends)."""
    global _LOOP
    if _LOOP is None:
        return

    async def close() -> None:
        if _CLIENTS:
            await _CLIENTS["ws"].close()
            await _CLIENTS["openai"].close()
            await _CLIENTS["http"].aclose()
            _CLIENTS.clear()

    _LOOP.run_until_complete(close())
    _LOOP.close()
    _LOOP = None


# ---- the run ----------------------------------------------------------------------------------------

class StepLog:
    """`--steps`: every batch the scheduler runs during a burst, as (new tokens, prefill tokens, its
    own seconds), read where the scheduler times it for `--prefill-chunk auto` (`StepCost.observe`),
    and the scheduler's chunk counters. `end` summarises the burst."""

    def __init__(self, host: Host, keep: bool = False) -> None:
        self.host, self.keep = host, keep
        self.batches: list[tuple[Any, ...]] = []  # (tokens, prefill tokens, seconds, forwards)
        self.on = False
        cost = host.scheduler.cost
        observe = cost.observe

        def logged(tokens: int, seconds: float, prefill: int = 0) -> None:
            if self.on:
                self.batches.append((tokens, prefill, seconds))
            observe(tokens, seconds, prefill)

        cost.observe = logged  # type: ignore[method-assign]
        stats = host.scheduler.stats
        record = stats.record

        def sized(size: int, tokens: int, waited: float, start: float, end: float) -> None:
            if self.on and self.batches and len(self.batches[-1]) == 3:  # (observe came first: its batch)
                self.batches[-1] += (size,)
            record(size, tokens, waited, start, end)

        stats.record = sized  # type: ignore[method-assign]

    def begin(self) -> None:
        st = self.host.scheduler.stats
        self.batches, self.on = [], True
        self.chunks0 = (st.chunked_prefills, st.prefill_chunks)

    def end(self, agents: int) -> dict[str, Any]:
        self.on = False
        st = self.host.scheduler.stats
        b = self.batches
        raw = [[x[3] if len(x) > 3 else None, x[0], x[1], round(1000 * x[2], 2)] for x in b]
        b = [x[:3] for x in b]
        pre = [x for x in b if x[1] > 0]
        dec = [x for x in b if x[1] == 0]
        ms = [1000 * s for _t, _p, s in b]

        def med(xs: list[float]) -> float | None:
            return round(statistics.median(xs), 2) if xs else None

        out: dict[str, Any] = {
            "batches": len(b), "batches_per_agent": round(len(b) / agents, 1),
            "prefill_batches": len(pre), "decode_only_batches": len(dec),
            "tokens": sum(t for t, _p, _s in b), "prefill_tokens": sum(p for _t, p, _s in b),
            "backend_s": round(sum(ms) / 1000, 3),
            "prefill_batches_s": round(sum(s for _t, _p, s in pre), 3),
            "decode_only_ms_median": med([1000 * s for _t, _p, s in dec]),
            "prefill_batch_ms_median": med([1000 * s for _t, _p, s in pre]),
            "prefill_tokens_per_batch_median": med([float(p) for _t, p, _s in pre]),
            "tokens_per_batch_mean": round(sum(t for t, _p, _s in b) / max(len(b), 1), 2),
            "chunked_prefills": st.chunked_prefills - self.chunks0[0],
            "prefill_chunks": st.prefill_chunks - self.chunks0[1],
            "prefill_budget_last": st.prefill_budget, "step_fit_ms_us": [st.step_fixed_ms, st.step_token_us],
        }
        if self.keep:
            out["batch_list"] = raw  # each batch: [forwards (loops' steps included), new tokens, prefill tokens, ms]
        return out


def _summary(runs: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Medians over the repeats of one way in one cell."""
    per_agent = [a for r in runs for a in r["agents"]]
    return {
        "latency_s_median": statistics.median(statistics.median(a["latency_s"] for a in r["agents"]) for r in runs),
        "agents_per_s": statistics.median(n / r["wall_s"] for r in runs),
        "wall_s": [round(r["wall_s"], 3) for r in runs],
        "ios_done": min(a["ios_done"] for a in per_agent),
        "completion_tokens_per_agent": statistics.mean(a["completion_tokens"] + a["peer_tokens"] for a in per_agent),
        "backend_tokens_per_agent": statistics.median(r["backend_tokens"] / n for r in runs),
        "load_1m": [round(r["load_1m"], 2) for r in runs],  # the machine's load average before each run
        "suspensions": sum(r["suspensions"] for r in runs),  # instances the host suspended (KV pressure)
        **({"steps": [r["steps"] for r in runs]} if all("steps" in r for r in runs) else {}),
    }


def _commit() -> str | None:
    """The checked-out commit, read from .git (no git process)."""
    git = ROOT / ".git"
    try:
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head[5:]
        common = Path((git / "commondir").read_text().strip()) if (git / "commondir").is_file() else None
        for base in (git, (git / common) if common else git):
            if (base / ref).is_file():
                return (base / ref).read_text().strip()
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    if line.endswith(" " + ref):
                        return line.split()[0]
    except OSError:
        return None
    return None


def targets(results: list[dict[str, Any]], levels: list[int], ios_levels: list[int]) -> dict[str, Any]:
    """The issue's targets at TARGET_IOS I/Os (or the largest swept count below it), and the trend
    of both ratios with the I/O count per kind x tool_ms x agents."""
    at = TARGET_IOS if TARGET_IOS in ios_levels else max([i for i in ios_levels if i <= TARGET_IOS] or ios_levels)
    lat = [r["latency_ratio"] for r in results if r["ios"] == at and r["agents"] == min(levels)]
    thr = [r["throughput_ratio"] for r in results if r["ios"] == at and r["agents"] == max(levels)]
    out: dict[str, Any] = {f"ios_{at}": {
        "ios": at, "latency_ratio_min": min(lat) if lat else None, "throughput_ratio_min": min(thr) if thr else None,
        "latency_ratio_target": TARGET_LATENCY, "throughput_ratio_target": TARGET_THROUGHPUT,
        "latency_at_agents": min(levels), "throughput_at_agents": max(levels),
        "met": min(lat) >= TARGET_LATENCY and min(thr) >= TARGET_THROUGHPUT if lat and thr else None}}
    trend: dict[str, Any] = {}
    for r in results:
        key = f"{r['kind']}/tool_ms={r['tool_ms']:g}/agents={r['agents']}"
        t = trend.setdefault(key, {"ios": [], "latency_ratio": [], "throughput_ratio": []})
        t["ios"].append(r["ios"])
        t["latency_ratio"].append(round(r["latency_ratio"], 3))
        t["throughput_ratio"].append(round(r["throughput_ratio"], 3))
    for t in trend.values():
        t["grows"] = len(t["ios"]) > 1 and t["latency_ratio"][-1] >= t["latency_ratio"][0] \
            and t["throughput_ratio"][-1] >= t["throughput_ratio"][0]
    out["trend"] = trend
    out["grows_with_ios"] = all(t["grows"] for t in trend.values()) if len(ios_levels) > 1 else None
    return out


def table(results: list[dict[str, Any]]) -> str:
    head = ("| kind | ios | tool ms | agents | inferlet latency s | client latency s | latency x | "
            "inferlet agents/s | client agents/s | throughput x | backend tokens/agent (inferlet / client) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {r['kind']} | {r['ios']} | {r['tool_ms']:g} | {r['agents']} | "
            f"{r['inferlet']['latency_s_median']:.3f} | {r['client']['latency_s_median']:.3f} | "
            f"{r['latency_ratio']:.2f} | {r['inferlet']['agents_per_s']:.3f} | {r['client']['agents_per_s']:.3f} | "
            f"{r['throughput_ratio']:.2f} | {r['inferlet']['backend_tokens_per_agent']:.0f} / "
            f"{r['client']['backend_tokens_per_agent']:.0f} |" for r in results]
    return head + "\n".join(rows) + "\n"


SWEEP_KEYS = ("kinds", "ios", "tool_ms", "agents", "tokens", "repeats", "quick", "kv_mib", "stand_in")


def _resumed(path: Path | None, config: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The finished cells and sessions of an earlier, interrupted run of the same sweep in `path`."""
    if path is None or not path.is_file():
        return [], []
    old = json.loads(path.read_text())
    if old.get("complete", True) or any(old["config"].get(k) != config[k] for k in SWEEP_KEYS):
        return [], []
    return old["results"], old.get("sessions", [])


def main(argv: list[str] | None = None, backend: Any = None, wasm: tuple[bytes, bytes] | None = None) -> int:
    """`backend`: run behind this backend object instead of the model or the stand-in (the GPU kit's
    agents section: the 1B shape on the GPU); `wasm`: the agent's and the OpenAI handler's components,
    prebuilt (a machine with no componentize-py)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="write the results here (after every cell too)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated agent kinds (react,codeact,swarm)")
    ap.add_argument("--ios", type=int, nargs="+", default=[2, 8, 32], help="I/O counts per agent (2 8 32)")
    ap.add_argument("--tool-ms", type=float, nargs="+", default=[0.0, 50.0], help="tool latencies, react (0 50)")
    ap.add_argument("--agents", type=int, nargs="+", default=[1, 8], help="agents at once (1 8)")
    ap.add_argument("--tokens", type=int, default=8, help="tokens per generation (8)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell and way; medians (2)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: the host's choice)")
    ap.add_argument("--kv-mib", type=int, default=1024,
                    help="KV cache budget in MiB (1024; 0: the host's default, 256 MiB on CPU, which 8 agents "
                         "at 32 I/Os overflow: the host then suspends instances, and both ways measure swapping)")
    ap.add_argument("--stand-in", action="store_true",
                    help="the stand-in backend instead of the model: a batch costs --step-ms plus --token-us per new "
                         "token (a GPU's regime, where model time is small beside the host's and the client's)")
    ap.add_argument("--step-ms", type=float, default=2.0,
                    help="with --stand-in: its time per batch (2.0: the H200 kit's 1B shape decodes a step "
                         "of 1 to 8 sequences in 1.7-1.8 ms, bench/gpu_h200_final.md)")
    ap.add_argument("--token-us", type=float, default=10.0,
                    help="with --stand-in: its time per new token in a batch (10: ~100k prefill tokens/s)")
    ap.add_argument("--resume", action="store_true",
                    help="keep the cells an interrupted run of the same sweep left in --json; run the rest")
    ap.add_argument("--prefill-chunk", default=None, metavar="auto|N",
                    help="the host's --prefill-chunk (default: the host's default); both ways run under it")
    ap.add_argument("--steps", action="store_true",
                    help="also record each burst's backend steps (the scheduler's batches: how many, their "
                         "tokens, prefill tokens and time; chunked prefills): `steps` per way in the JSON")
    ap.add_argument("--batch-list", action="store_true",
                    help="with --steps: every batch too ([forwards, new tokens, prefill tokens, ms]; a long JSON)")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): every kind at ios 2, 4 tokens, agents 1 and 2, tool-ms 0, 1 repeat")
    a = ap.parse_args(argv)
    if a.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(ios=[2], tokens=4, agents=[1, 2], tool_ms=[0.0], repeats=1)
        a = ap.parse_args(argv)
    kinds = [k for k in a.kinds.split(",") if k]
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds: choose from {', '.join(KINDS)}")
    script()  # fail early on the inferlet's module
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("host.wasm.warm").setLevel(logging.INFO)  # a warm pool that gives up is said
    config: dict[str, Any] = {"kinds": kinds, "ios": a.ios, "tool_ms": a.tool_ms, "agents": a.agents,
                              "tokens": a.tokens, "repeats": a.repeats, "quick": a.quick, "kv_mib": a.kv_mib,
                              "tool_ms_applies_to": ["react"],
                              "stand_in": {"step_ms": a.step_ms, "token_us": a.token_us} if a.stand_in else None}
    results, sessions = _resumed(a.json, config) if a.resume else ([], [])
    done = {(r["kind"], r["ios"], r["tool_ms"], r["agents"]) for r in results}
    cells = [(kind, ios, tool_ms, n) for kind in kinds for ios in a.ios
             for tool_ms in (a.tool_ms if kind == "react" else [0.0]) for n in a.agents]
    todo = [c for c in cells if c not in done]

    t_start, load_at_start = time.perf_counter(), os.getloadavg()[0]
    session: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "cells": len(todo),
                               "load_1m_at_start": load_at_start}
    sessions.append(session)
    tools = start_tool_server()
    tool_base = f"http://127.0.0.1:{tools.server_address[1]}"
    agent_wasm, openai_wasm = wasm or (resolve_inferlet(AGENT_DIR, quiet=True).read_bytes(),
                                       resolve_inferlet("openai_chat", quiet=True).read_bytes())
    data_dir = Path(tempfile.mkdtemp(prefix="pie-bench-agent-io-"))
    extra: dict[str, Any] = {}
    if a.prefill_chunk is not None:
        extra["prefill_chunk"] = a.prefill_chunk if a.prefill_chunk == "auto" else int(a.prefill_chunk)
    hc = HostConfig(data_dir=data_dir, device=a.device, kv_memory_bytes=a.kv_mib * 2**20 if a.kv_mib else None,
                    http_allow=(f"127.0.0.1:{tools.server_address[1]}",), **extra)
    if backend is not None:
        host = Host(hc, backend=backend, progress=False)
    elif a.stand_in:
        backend = StandInBackend(page_size=16, num_pages=16384, delay_s=a.step_ms / 1000, token_s=a.token_us / 1e6)
        host = Host(hc, backend=backend, progress=False)
    else:
        host = Host(hc, progress=False)
    steps = StepLog(host, a.batch_list) if a.steps else None
    config.update(prefill_chunk=host.config.prefill_chunk, prefill_ratio=host.config.prefill_ratio,
                  model=host.model_name, device=str(getattr(host.backend.info, "device", a.device or "?")),
                  prefix_cache=host.config.prefix_cache, workers=host.config.worker_count, kv_pages=host.total_pages,
                  page_size=host.config.page_size)
    phases = session["phases_s"] = {"start_s": 0.0, "warm_up_s": 0.0, "settle_s": 0.0}
    settle_failures: list[str] = []
    session["settle_failures"] = settle_failures

    def document(complete: bool) -> dict[str, Any]:
        session["wall_s"] = round(time.perf_counter() - t_start, 1)
        stats = host.stats()
        session["host_stats"] = {k: stats[k] for k in ("memory", "prefix_cache", "http", "children")}
        out = {"config": config, "results": results, "targets": targets(results, a.agents, a.ios) if results else {},
               "machine": {"platform": platform.platform(), "machine": platform.machine(),
                           "python": platform.python_version(), "cpus": multiprocessing.cpu_count(),
                           "device": config["device"], "load_1m_at_start": sessions[0]["load_1m_at_start"]},
               "commit": _commit(), "date": session["date"], "complete": complete,
               "wall_s": round(sum(x.get("wall_s", 0.0) for x in sessions), 1), "sessions": sessions}
        if a.json:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(out, indent=2) + "\n")
        return out

    server: Server | None = None
    try:
        agent_prog = host.compile(agent_wasm)
        openai_prog = host.compile(openai_wasm)
        server = Server(host, ServerConfig(port=0, data_dir=data_dir), openai_program=openai_prog)
        server.start_background()
        assert asyncio.run(_upload(server.url, agent_wasm)) == agent_prog  # protocol v1 runs programs from its store
        info = {"http": server.http_url, "ws": server.url, "model": host.model_name, "program": agent_prog}
        bursts = [0]
        phases["start_s"] = round(time.perf_counter() - t_start, 1)
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            def burst(way: str, kind: str, n: int, ios: int, tool_ms: float) -> dict[str, Any]:
                t = time.perf_counter()
                for program, want in ((agent_prog, 2 * n if kind == "swarm" else n), (openai_prog, n)):
                    try:
                        settle(host, program, want)
                    except RuntimeError as e:  # the burst starts (partly) cold: said in the JSON, not hidden
                        settle_failures.append(f"{way} {kind} ios {ios} agents {n}: "
                                               f"{'agent_io' if program == agent_prog else 'openai_chat'}: {e}")
                        print(f"settle: {settle_failures[-1]}", file=sys.stderr, flush=True)
                phases["settle_s"] = round(phases["settle_s"] + time.perf_counter() - t, 1)
                tokens0, load = host.scheduler.stats.tokens, os.getloadavg()[0]
                if steps is not None:
                    steps.begin()
                suspended0 = host.memory_stats().get("suspensions", 0)
                bursts[0] += 1
                r = pool.submit(drive, way, info, kind, n, ios, a.tokens, f"{tool_base}/ms{tool_ms:g}",
                                bursts[0]).result()
                r["backend_tokens"] = host.scheduler.stats.tokens - tokens0
                if steps is not None:
                    r["steps"] = steps.end(n)
                r["load_1m"] = load
                r["suspensions"] = host.memory_stats().get("suspensions", 0) - suspended0
                short = [x["ios_done"] for x in r["agents"] if x["ios_done"] != ios]
                if short:
                    raise RuntimeError(f"{way} {kind}: agents did {short} I/Os, not {ios}")
                return r

            for kind in sorted({c[0] for c in todo}, key=kinds.index) if not a.quick else []:
                for way in WAYS:  # warm-up at the largest agent count: the client process, the warm pools
                    burst(way, kind, max(a.agents), 1, 0.0)  # (--quick measures nothing: none)
            phases["warm_up_s"] = round(time.perf_counter() - t_start - phases["start_s"], 1)
            for k, (kind, ios, tool_ms, n) in enumerate(todo):
                runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
                for rep in range(a.repeats):
                    for way in WAYS if (k + rep) % 2 == 0 else WAYS[::-1]:  # neither way always first
                        runs[way].append(burst(way, kind, n, ios, tool_ms))
                row: dict[str, Any] = {"kind": kind, "ios": ios, "tool_ms": tool_ms, "agents": n,
                                       **{w: _summary(runs[w], n) for w in WAYS}}
                row["latency_ratio"] = row["client"]["latency_s_median"] / row["inferlet"]["latency_s_median"]
                row["throughput_ratio"] = row["inferlet"]["agents_per_s"] / row["client"]["agents_per_s"]
                results.append(row)
                results.sort(key=lambda r: cells.index((r["kind"], r["ios"], r["tool_ms"], r["agents"])))
                document(complete=False)
                print(f"{kind:8s} ios {ios:3d} tool {tool_ms:3g} ms agents {n:2d}: latency "
                      f"{row['inferlet']['latency_s_median']:.3f} s vs {row['client']['latency_s_median']:.3f} s "
                      f"(x{row['latency_ratio']:.2f}), agents/s {row['inferlet']['agents_per_s']:.3f} vs "
                      f"{row['client']['agents_per_s']:.3f} (x{row['throughput_ratio']:.2f})", file=sys.stderr, flush=True)
                for way in WAYS if a.steps else ():
                    for st in row[way].get("steps", []):
                        print(f"  {way:8s} steps: {st['batches']} batches ({st['batches_per_agent']}/agent), "
                              f"{st['prefill_batches']} with prefill ({st['prefill_tokens']} tokens, median "
                              f"{st['prefill_tokens_per_batch_median']}/batch, {st['prefill_batch_ms_median']} ms), "
                              f"decode-only median {st['decode_only_ms_median']} ms, backend {st['backend_s']} s, "
                              f"chunks {st['prefill_chunks']} of {st['chunked_prefills']} prefills",
                              file=sys.stderr, flush=True)
            pool.submit(close_clients).result()
        out = document(complete=True)
    finally:
        if server is not None:
            server.stop_background()
        host.shutdown()
        tools.shutdown()
    print(table(results))
    tg = next(v for key, v in out["targets"].items() if key.startswith("ios_"))
    print(f"targets at {tg['ios']} I/Os: latency x{tg['latency_ratio_min']:.2f} (>= {TARGET_LATENCY}), "
          f"throughput x{tg['throughput_ratio_min']:.2f} (>= {TARGET_THROUGHPUT}): "
          f"{'met' if tg['met'] else 'not met'}; growing with the I/O count: {out['targets']['grows_with_ios']}")
    return 0


async def _upload(url: str, wasm: bytes) -> str:
    from host.client import PieClient

    async with await PieClient.connect(url) as client:
        return await client.ensure_program(wasm)


if __name__ == "__main__":
    sys.exit(main())
