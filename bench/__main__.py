"""`python -m bench SUITE [--quick] [--json OUT] [--only NAME,...] [-- ARGS]`: the benchmarks as a
few suites (bench/README.md says what each measures). A suite runs its scripts one after another,
each as `python bench/NAME.py` from the repository root, as their docstrings say to run them; each
script prints its own table and compares against its own baseline in the same run. The suite then
prints one line per script and, with `--json OUT`, writes every script's JSON under one file with
the machine, the date and the commit. `--quick`: each script's small mode (a few seconds to a
minute, numbers that mean nothing: what CI and `make bench` run). ARGS after `--` go to the
script (one script: a suite of one, or `--only` one).

`python -m bench NAME ARGS...` with a script's name (`host_scale`, `kv_pressure`, ...) runs that
script with ARGS as they are. `python -m bench list` lists the suites and scripts; `python -m bench
all --quick` runs every suite."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
# gpu_suite's CPU dry run in --quick: its sections but `pytest` (the suite's own tests run it), and
# no FlexAttention (it compiles for minutes on CPU); tests/test_gpu_suite.py runs the whole dry run
GPU_QUICK_SECTIONS = "env,parity,decode,run256,host,decode8b,qwen3"


@dataclass(frozen=True)
class Step:
    """One run of a script in a suite: `key` names its JSON in the suite's, `args` always go to it."""

    key: str
    script: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Suite:
    what: str
    steps: tuple[Step, ...]


def _steps(*names: str) -> tuple[Step, ...]:
    return tuple(Step(n, n) for n in names)


SUITES: dict[str, Suite] = {
    "host": Suite("the host in front of a stand-in GPU step: efficiency at 1-256 instances (app, step), bursts "
                  "back to back on a fresh host, guests in worker processes vs in the host's",
                  (Step("host_scale", "host_scale"), Step("host_scale_b2b", "host_scale", ("--back-to-back",)),
                   Step("workers", "workers"))),
    "serve": Suite("a live pie-serve under OpenAI clients: req/s, TTFT, TPOT, tool calls and Responses, vs the "
                   "WebSocket protocol and the host driven directly",
                   _steps("openai_load", "server_load")),
    "backend": Suite("the PyTorch backend vs transformers on the same weights: batched decode, text embeddings and "
                     "image prefill; FlexAttention vs SDPA", _steps("backend_decode", "embeddings", "flex_attention")),
    "kv": Suite("KV pressure: instances needing 4x / 8x the pool, suspended and resumed (swap vs re-prefill)",
                _steps("kv_pressure")),
    "agents": Suite("agents: tools run on the server (inferlets) vs a client driving the endpoint; KV kept across "
                    "turns vs a stateless API", _steps("agent_io", "agents")),
    "gpu": Suite("the GPU kit: parity, decode vs transformers, a 256-request run, the host's tax, 8B and Qwen3 "
                 "shapes (on CUDA; --quick: its CPU dry run); the Triton paged decode attention vs SDPA",
                 _steps("gpu_suite", "triton_attention")),
    "qos": Suite("decodes' token gaps while a long prompt prefills, by prefill chunk; priorities, tenants",
                 _steps("qos")),
    "embeddings": Suite("text embeddings and image prefill per second vs transformers", _steps("embeddings")),
    "prefix": Suite("16 requests sharing a system prompt, prefix cache on vs off", _steps("prefix_cache")),
    "grammar": Suite("structured generation: mask cost vs another library, constrained decode, the host loop",
                     _steps("grammar", "grammar_host")),
    "load": Suite("load_backend's time and peak RSS, cold and cached (--baseline REV: a revision alongside)",
                  _steps("load_model")),
    "internals": Suite("the host's parts one by one: host-call cost and the programmability tax (real model), "
                       "the scheduler per batch, arrivals vs running streams, sustained load, value conversions, "
                       "an engine process, revisions compared",
                       _steps("host_overhead", "host_loops", "host_arrivals", "host_sustained", "conversions",
                              "engine", "revisions")),
}
ORDER = ("host", "serve", "backend", "kv", "agents", "gpu", "qos", "embeddings", "prefix", "grammar", "load",
         "internals")


def scripts() -> list[str]:
    """Every bench script (bench/common.py is their shared code, _*.py a script's own part)."""
    return sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_") and p.stem != "common")


def _machine() -> dict[str, Any]:
    def out(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    gpus = out(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"])
    return {"commit": out(["git", "rev-parse", "--short", "HEAD"]),
            "dirty": bool(out(["git", "status", "--porcelain", "--untracked-files=no"])),
            "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs" + (f", {gpus.replace(chr(10), ' + ')}" if gpus else ""),
            "python": platform.python_version()}


def _command(step: Step, quick: bool, out: Path, extra: list[str]) -> tuple[list[str], Path, dict[str, str]]:
    """The command running `step` (its JSON at `out`, or gpu_suite's under out's folder), the JSON's
    path and the environment."""
    env = dict(os.environ)
    cmd = [sys.executable, f"bench/{step.script}.py", *step.args]
    if step.script == "gpu_suite":
        folder = out.parent / step.key
        if quick:
            cmd += ["--dry-run", "--sections", GPU_QUICK_SECTIONS]
        return [*cmd, "--out", str(folder), *extra], folder / "gpu_suite.json", env
    return [*cmd, *(["--quick"] if quick else []), "--json", str(out), *extra], out, env


def run_suite(names: list[str], quick: bool, json_out: Path | None, only: set[str] | None, extra: list[str]) -> int:
    steps, seen = [], set()
    for name in names:
        for step in SUITES[name].steps:
            if (only is None or step.key in only or step.script in only) and step.key not in seen:
                steps.append((name, step))
                seen.add(step.key)
    if not steps:
        print(f"nothing to run: --only {','.join(sorted(only or ()))} names none of "
              f"{', '.join(s.key for n in names for s in SUITES[n].steps)}", file=sys.stderr)
        return 2
    if extra and len(steps) > 1:
        print("arguments after -- go to one script: pick it with --only", file=sys.stderr)
        return 2
    meta = _machine()
    results: dict[str, Any] = {}
    rows: list[tuple[str, str, int, float]] = []
    with tempfile.TemporaryDirectory(prefix="pie-bench-") as tmp:
        for suite, step in steps:
            cmd, out, env = _command(step, quick, Path(tmp) / f"{step.key}.json", extra)
            print(f"\n## {suite}: {step.key}  ({' '.join(cmd[1:])})", flush=True)
            t0 = time.perf_counter()
            rc = subprocess.run(cmd, cwd=ROOT, env=env).returncode
            rows.append((suite, step.key, rc, time.perf_counter() - t0))
            if rc == 0 and out.is_file():
                results.setdefault(suite, {})[step.key] = json.loads(out.read_text())
    print(f"\n{meta['machine']}, {meta['date']}, commit {meta['commit']}{' (+ changes)' if meta['dirty'] else ''}"
          f"{', --quick (the numbers mean nothing)' if quick else ''}\n")
    print("| suite | script | result | seconds |\n|---|---|---|---|")
    for suite, key, rc, s in rows:
        print(f"| {suite} | {key} | {'ok' if rc == 0 else f'FAILED (exit {rc})'} | {s:.0f} |")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({**meta, "quick": quick, "suites": names, "results": results}, indent=1) + "\n")
        print(f"\nwrote {json_out}")
    return 0 if all(rc == 0 for *_, rc, _s in rows) else 1


def _list() -> str:
    lines = ["suites (python -m bench SUITE [--quick] [--json OUT] [--only NAME,...] [-- ARGS]):"]
    for name in ORDER:
        steps = ", ".join(s.key for s in SUITES[name].steps)
        lines.append(f"  {name:<11} {SUITES[name].what} [{steps}]")
    lines += ["  all         every suite above, in that order",
              "scripts (python -m bench NAME ARGS: bench/NAME.py ARGS as they are):",
              "  " + " ".join(scripts())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__ + "\n\n" + _list())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name in scripts() and name not in SUITES:
        return subprocess.run([sys.executable, f"bench/{name}.py", *rest], cwd=ROOT).returncode
    if name != "all" and name not in SUITES:
        print(f"no suite or script {name!r}\n\n{_list()}", file=sys.stderr)
        return 2
    extra: list[str] = []
    if "--" in rest:
        rest, extra = rest[:rest.index("--")], rest[rest.index("--") + 1:]
    ap = argparse.ArgumentParser(prog=f"python -m bench {name}",
                                 description=(SUITES[name].what if name in SUITES else "every suite"))
    ap.add_argument("--quick", action="store_true", help="each script's small mode (CI; numbers mean nothing)")
    ap.add_argument("--json", type=Path, default=None, help="write every script's results here, in one file")
    ap.add_argument("--only", default=None, help="comma-separated script keys of the suite to run")
    a = ap.parse_args(rest)
    only = set(a.only.split(",")) if a.only else None
    return run_suite(list(ORDER) if name == "all" else [name], a.quick, a.json, only, extra)


if __name__ == "__main__":
    sys.exit(main())
