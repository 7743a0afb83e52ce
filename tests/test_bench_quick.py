"""Every bench script end to end in its small mode (`--quick`, or gpu_suite's `--dry-run`): it runs,
goes through the code it measures and writes its JSON, so a bench broken by a change fails here
instead of for its next reader. The numbers are not checked (a few seconds of work measure nothing);
one key each script documents is. Each runs as `python bench/NAME.py` from the repository root, as
the scripts' docstrings say to run them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLOW, BUILD = pytest.mark.slow, pytest.mark.build  # the real model / a componentize-py build of an inferlet

# script -> (marks, a key its JSON has); each line's --quick wall time measured on the 2-core VM
SCRIPTS: dict[str, tuple[list[pytest.MarkDecorator], str]] = {
    "agent_io": ([SLOW, BUILD], "results"),  # the inferlet vs the client-driven agent, both ways once
    "agents": ([SLOW, BUILD], "throughput_ratio"),  # ~36 s
    "backend_decode": ([SLOW], "meta"),  # ~46 s: two backends and two transformers models loaded
    "cold_launch": ([BUILD], "modes"),  # ~13 s
    "conversions": ([], "conversions"),  # ~2 s
    "embeddings": ([SLOW], "image"),  # ~50 s: the default model and a LLaVA-shaped one, both ways
    "engine": ([SLOW, BUILD], "standin"),  # ~18 s
    "flex_attention": ([SLOW], "results"),  # ~27 s: flex compiles each shape on CPU
    "grammar": ([SLOW], "host_loop"),  # ~17 s
    "grammar_host": ([SLOW], "host_loop"),  # ~10 s
    "host_arrivals": ([BUILD], "warm"),  # ~10 s
    "host_context": ([BUILD], "us_per_token"),  # ~4 s
    "host_lookahead": ([BUILD], "instances"),  # ~6 s
    "host_loops": ([], "loops"),  # ~3 s
    "host_overhead": ([SLOW, BUILD], "call_us"),
    "host_ramp": ([BUILD], "default"),  # ~16 s
    "host_scale": ([BUILD], "rss_mb_per_instance"),
    "host_step_gap": ([BUILD], "gap_ms"),  # ~5 s
    "host_sustained": ([BUILD], "results"),  # ~11 s
    "instance_start": ([BUILD], "variants"),  # ~5 s
    "kv_pressure": ([SLOW, BUILD], "real_cpu"),  # ~14 s
    "load_model": ([SLOW], "results"),  # ~12 s
    "openai_load": ([SLOW, BUILD], "tools"),  # ~34 s
    "prefix_cache": ([SLOW, BUILD], "prefilled_tokens"),  # ~9 s
    "qos": ([], "standin"),  # ~1 s (the stand-in only; --real adds the model)
    "revisions": ([BUILD], "revisions"),  # HEAD checked out and its text_completion built (~30 s)
    "server_load": ([SLOW, BUILD], "baseline"),  # ~21 s
    "start_path": ([BUILD], "rounds"),  # ~8 s
    "workers": ([BUILD], "settings"),  # ~12 s: two hosts, 1 s windows
    # the dry run's sections but `pytest` (~24 s); tests/test_gpu_suite.py runs the whole dry run
    "gpu_suite": ([SLOW, BUILD], "host"),
}
GPU_SECTIONS = "env,parity,decode,run256,host,decode8b,qwen3"


def test_every_bench_script_is_here() -> None:
    """A new bench script gets its line in SCRIPTS (bench/common.py is the scripts' shared code, a
    module named _*.py a script's own part: bench/_burst_tree.py is bench/revisions.py's)."""
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if not p.stem.startswith("_")} - {"common"}
    assert scripts == set(SCRIPTS)


def _command(name: str, tmp_path: Path) -> tuple[list[str], Path, dict[str, str]]:
    env = dict(os.environ)
    if name == "gpu_suite":  # CUDA-only: its CPU dry run (flex compiles for minutes on CPU; its own tests)
        env["PIE_KIT_NO_FLEX"] = "1"
        return ([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(tmp_path), "--sections", GPU_SECTIONS],
                tmp_path / "gpu_suite.json", env)
    out = tmp_path / "out.json"
    return [sys.executable, f"bench/{name}.py", "--quick", "--json", str(out)], out, env


@pytest.mark.parametrize("name", [pytest.param(name, marks=marks, id=name) for name, (marks, _) in SCRIPTS.items()])
def test_quick_run_writes_its_json(name: str, tmp_path: Path) -> None:
    cmd, out, env = _command(name, tmp_path)
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res: Any = json.loads(out.read_text())
    assert isinstance(res, dict) and res, res
    assert SCRIPTS[name][1] in res, sorted(res)
    if name == "gpu_suite":
        assert not [k for k, v in res.items() if "error" in v], res
