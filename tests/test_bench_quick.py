"""Every bench script end to end in its small mode, through the entry point CI and `make bench` use
(`python -m bench SUITE --quick --only KEY`; gpu_suite's `--quick` is its CPU dry run): it runs,
goes through the code it measures and writes its JSON, so a bench broken by a change fails here
instead of for its next reader. The numbers are not checked (a few seconds of work measure nothing);
one key each script documents is."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SLOW, BUILD = pytest.mark.slow, pytest.mark.build  # the real model / a componentize-py build of an inferlet
HEAVY = pytest.mark.heavy  # a subprocess run of seconds that needs neither (not in make test-fast)


def _entry_point() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_entry_point", ROOT / "bench" / "__main__.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


BENCH = _entry_point()

# a suite's script (its key in bench/__main__.py's SUITES) -> (marks, a key its JSON has); each
# line's --quick wall time measured on the 2-core VM
SCRIPTS: dict[str, tuple[list[pytest.MarkDecorator], str]] = {
    "agent_io": ([SLOW, BUILD], "results"),  # the inferlet vs the client-driven agent, both ways once
    "agents": ([SLOW, BUILD], "throughput_ratio"),  # ~36 s
    "backend_decode": ([SLOW], "meta"),  # ~46 s: two backends and two transformers models loaded
    "conversions": ([HEAVY], "conversions"),  # ~2 s
    "embeddings": ([SLOW], "image"),  # ~50 s: the default model and a LLaVA-shaped one, both ways
    "engine": ([SLOW, BUILD], "standin"),  # ~18 s
    "flex_attention": ([SLOW], "results"),  # ~27 s: flex compiles each shape on CPU
    "grammar": ([SLOW], "host_loop"),  # ~17 s
    "grammar_host": ([SLOW], "host_loop"),  # ~10 s
    "host_arrivals": ([BUILD], "warm"),  # ~10 s
    "host_loops": ([HEAVY], "loops"),  # ~3 s
    "host_overhead": ([SLOW, BUILD], "call_us"),
    "host_scale": ([BUILD], "rss_mb_per_instance"),
    "host_scale_b2b": ([BUILD], "back_to_back"),  # host_scale.py --back-to-back
    "host_sustained": ([BUILD], "results"),  # ~11 s
    "kv_pressure": ([SLOW, BUILD], "real_cpu"),  # ~14 s
    "load_model": ([SLOW], "results"),  # ~12 s
    "openai_load": ([SLOW, BUILD], "tools"),  # ~34 s
    "prefix_cache": ([SLOW, BUILD], "prefilled_tokens"),  # ~9 s
    "qos": ([HEAVY], "standin"),  # ~1 s (the stand-in only; --real adds the model)
    "revisions": ([BUILD], "revisions"),  # HEAD checked out and its text_completion built (~30 s)
    "server_load": ([SLOW, BUILD], "baseline"),  # ~21 s
    "workers": ([BUILD], "settings"),  # ~12 s: two hosts, 1 s windows
    # the dry run's sections but `pytest` (~24 s); tests/test_gpu_suite.py runs the whole dry run
    "gpu_suite": ([SLOW, BUILD], "host"),
    "triton_attention": ([HEAVY], "kernel"),  # ~10 s: tiny shapes in Triton's interpreter on CPU
}
# each script's first suite (a script in two suites, embeddings, runs once)
SUITE_OF = {step.key: name for name in reversed(BENCH.ORDER) for step in BENCH.SUITES[name].steps}


def test_every_bench_script_is_here() -> None:
    """A new bench script gets a suite and its line in SCRIPTS (bench/common.py is the scripts' shared
    code, a module named _*.py a script's own part: bench/_burst_tree.py is bench/revisions.py's)."""
    assert set(BENCH.scripts()) == {s.script for suite in BENCH.SUITES.values() for s in suite.steps}
    assert set(SUITE_OF) == set(SCRIPTS)
    assert set(BENCH.ORDER) == set(BENCH.SUITES)


def test_the_entry_point_lists_its_suites_and_refuses_what_it_lacks() -> None:
    r = subprocess.run([sys.executable, "-m", "bench", "list"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and all(f"  {name} " in r.stdout for name in BENCH.ORDER), r.stdout + r.stderr
    for args in (["nope"], ["host", "--only", "nope"], ["host", "--", "--instances", "4"]):
        r = subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stdout, r.stderr)


@pytest.mark.parametrize("key", [pytest.param(key, marks=marks, id=key) for key, (marks, _) in SCRIPTS.items()])
def test_quick_run_writes_its_json(key: str, tmp_path: Path) -> None:
    out, suite = tmp_path / "out.json", SUITE_OF[key]
    r = subprocess.run([sys.executable, "-m", "bench", suite, "--quick", "--only", key, "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"| {suite} | {key} | ok |" in r.stdout  # the suite's table
    suites: Any = json.loads(out.read_text())
    assert suites["quick"] is True and suites["commit"] and suites["machine"], sorted(suites)
    res = suites["results"][suite][key]
    assert isinstance(res, dict) and res, res
    assert SCRIPTS[key][1] in res, sorted(res)
    if key == "gpu_suite":
        assert not [k for k, v in res.items() if "error" in v], res
