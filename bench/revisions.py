"""The same bursts on several revisions of this repository, alternated in one run: the script to find
which commit a host regression came from (issue 56: bursts of 64 behind a forward-only backend).

Usage: python bench/revisions.py --json OUT [--revs 3f426ae HEAD] [--rounds 3] [--sizes 64 256 64 256]
                                 [--step-ms 10] [--tokens 64] [--config '{"warm_yield": false}'] [--quick]

Each revision is checked out once into a git worktree under --workdir (kept, so a bisect reuses
them) and runs bench/_burst_tree.py in a process of its own with that tree first on PYTHONPATH
and its own build cache (PIE_CACHE_DIR: each tree builds `text_completion` from its own SDK and
WIT). The workload is the one a user with their own backend meets: a backend that has only
`forward` (10 ms per batch, the stand-in behind a wrapper without `start_forward`), a fresh host
(`Host(HostConfig(**config), backend=...)`, no warm start), the standard `text_completion --raw`
with `--tokens` new tokens, launched in bursts of `--sizes`, each the moment the one before ended.
Per burst: `efficiency` (tokens/s over n * tokens / ((tokens + 1) * step)), `ramp_ms` (launch to
the first backend call holding 90% of n; -1: none did), `period_ms` (median start-to-start of two
calls both holding n), `tail_ms` (last backend call's end to the last end event), `cpu_ms` (the
process's CPU per instance), `warm` (parked instances the burst's launches found). The rounds
alternate the revisions, so the machine's drift falls on all of them alike; `by_size` is the
median of each size's bursts over the rounds, as issue 56 counts them.

Single bursts on a 2-vCPU VM spread by +-0.15 (bench/HISTORY.md, "Issue 56"): compare medians over
three or more rounds. `--quick` (CI): HEAD only, one round, bursts of 8 16 8, 16 tokens.
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
INNER = Path(__file__).resolve().parent / "_burst_tree.py"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--revs", nargs="+", default=["HEAD"], help="git revisions to compare (default: HEAD)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every revision, alternated")
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 64, 256], help="the bursts, in order")
    ap.add_argument("--step-ms", type=float, default=10.0, help="the backend's time per batch")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per instance")
    ap.add_argument("--config", default="{}", help="HostConfig fields as JSON (every revision must know them)")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "pie-revisions",
                    help="where the worktrees and their build caches are kept")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): HEAD, one round, bursts of 8 16 8, 16 tokens")
    opts = ap.parse_args()
    if opts.quick:
        opts.revs, opts.rounds, opts.sizes, opts.tokens = ["HEAD"], 1, [8, 16, 8], 16
    if opts.rounds < 1 or min(opts.sizes) < 1 or opts.tokens < 1 or opts.step_ms <= 0:
        ap.error("--rounds, --sizes and --tokens must be at least 1 and --step-ms above 0")
    try:
        json.loads(opts.config)
    except json.JSONDecodeError as e:
        ap.error(f"--config is not JSON: {e}")
    return opts


def worktree(rev: str, workdir: Path) -> tuple[str, Path]:
    """(the revision's short hash, a checkout of it under `workdir`)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    tree = workdir / f"tree-{sha}"
    if not (tree / "host").is_dir():
        workdir.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "worktree", "add", "--force", "--detach", str(tree), sha], cwd=ROOT, check=True,
                       capture_output=True)
    return sha, tree


def run_tree(sha: str, tree: Path, workdir: Path, opts: argparse.Namespace) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PIE_CACHE_DIR": str(workdir / f"cache-{sha}")}
    args = [sys.executable, str(INNER), "--step-ms", str(opts.step_ms), "--tokens", str(opts.tokens),
            "--config", opts.config, "--sizes", *map(str, opts.sizes)]
    out = subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{sha}: the bursts failed:\n{out.stderr[-3000:]}")
    bursts: list[dict[str, Any]] = json.loads(out.stdout.strip().splitlines()[-1])
    return bursts


def main() -> None:
    opts = parse_args()
    trees = [worktree(rev, opts.workdir) for rev in opts.revs]
    runs: dict[str, list[list[dict[str, Any]]]] = {sha: [] for sha, _ in trees}
    for _ in range(opts.rounds):
        for sha, tree in trees:
            runs[sha].append(run_tree(sha, tree, opts.workdir, opts))
            print(sha, [b["efficiency"] for b in runs[sha][-1]], flush=True)
    res: dict[str, Any] = {"sizes": opts.sizes, "step_ms": opts.step_ms, "tokens": opts.tokens,
                           "config": json.loads(opts.config), "cores": os.cpu_count(), "revisions": {}}
    for sha, rounds in runs.items():
        by_size = {str(n): round(statistics.median(b["efficiency"] for burst in rounds for b in burst if b["n"] == n), 3)
                   for n in dict.fromkeys(opts.sizes)}
        res["revisions"][sha] = {"by_size": by_size, "rounds": rounds}
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps(res, indent=2))
    lines = [f"# bench/revisions.py: bursts {opts.sizes} back to back, forward-only backend, {opts.step_ms:g} ms, "
             f"`text_completion --raw` {opts.tokens} tokens, config {opts.config}", "",
             "| revision | median by size | efficiency per burst (each round) | tail ms (each round) |",
             "|---|---|---|---|"]
    for sha, r in res["revisions"].items():
        effs = [[b["efficiency"] for b in burst] for burst in r["rounds"]]
        tails = [[b["tail_ms"] for b in burst] for burst in r["rounds"]]
        lines.append(f"| {sha} | " + ", ".join(f"{n}: {e}" for n, e in r["by_size"].items()) + f" | {effs} | {tails} |")
    md = "\n".join(lines) + "\n"
    opts.json.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
