"""The GPU kit (bench/gpu_suite.py) end to end on CPU (`--dry-run`, tiny shapes): every section runs
and writes its JSON and markdown, so the first minute on a GPU machine is not spent on a typo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.build]


def test_dry_run_runs_every_section(tmp_path):
    env = dict(os.environ)  # (flex, which compiles for minutes on CPU, is not among the default paths)
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert set(res) == {"env", "parity", "decode", "run256", "prefill", "host", "workers", "decode8b", "qwen3",
                        "pytest", "agents"}
    assert not [k for k, v in res.items() if "error" in v], res
    p = res["parity"]
    assert p["small_fp32_max_logit_diff"] < 1e-3 and p["sdpa_graphs_on_equals_off"] and p["sdpa_overlap_on_equals_off"]
    assert p["sdpa_ragged_and_tree_mask"] == p["sdpa_hidden_token"] == "equal"
    # the compiled layers (run through the graphs' static buffers on CPU): == uncompiled, == graphs off
    assert p["sdpa_compiled_equals_uncompiled"] is True and p["sdpa_graphs_on_equals_off_compiled"] is True
    # every path measured, the triton one through Triton's interpreter (its parity checks too)
    for key in ("sdpa", "sdpa+graphs", "transformers", "sdpa+graphs+compile", "triton", "triton+graphs",
                "triton+graphs+compile"):
        assert all(isinstance(v, float) and v > 0 for v in res["decode"]["tokens_per_s"][key].values()), key
    assert p["triton_graphs_on_equals_off"] and p["triton_equals_sdpa"] is True and p["triton_ragged_and_tree_mask"] == "equal"
    assert all(isinstance(v, float) and v > 0 for v in res["prefill"]["tokens_per_s"].values())
    wk = res["workers"]["settings"]  # the closed loop, in-process vs a worker, the kit's component
    assert wk["0"]["completions_s"] > 0 and wk["1"]["completions_s"] > 0 and wk["1"]["worker_processes"] == 1
    assert res["run256"]["sdpa+graphs"]["tokens_per_s"] > 0 and res["run256"]["sdpa+graphs+compile"]["tokens_per_s"] > 0
    assert "sdpa+graphs+compile" not in res["qwen3"]["tokens_per_s"]  # (the dry run compiles one shape)
    assert all(isinstance(v, float) and v > 0 for v in res["qwen3"]["tokens_per_s"]["sdpa+graphs"].values())
    row = res["host"]["concurrency"]["4"]
    assert row["host_ahead_tokens_per_s"] > 0 and row["host_no_ahead_tokens_per_s"] > 0
    assert res["pytest"]["returncode"] == 0  # (every GPU test skips on CPU; collection must succeed)
    ag = res["agents"]  # agent_io behind the kit's model: every kind both ways, the same I/Os
    assert {r["kind"] for r in ag["rows"]} == {"react", "codeact", "swarm"} and ag["config"]["model"] == "kit"
    assert all(r["inferlet_agents_per_s"] > 0 and r["client_agents_per_s"] > 0 for r in ag["rows"])
    assert json.loads((tmp_path / "agent_io.json").read_text())["results"]
    md = (tmp_path / "gpu_suite.md").read_text()
    assert "## host tax" in md and "## decode: llama-1b" in md and "## agents" in md and "## prefill" in md and "## workers" in md


def test_bad_arguments_are_refused():
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", "x", "--sections", "env,nope"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown sections ['nope']" in r.stderr
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", "x", "--host-config", "nope=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "expected FIELD=VALUE with a HostConfig field" in r.stderr
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", "x", "--workers", "0", "many"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--workers" in r.stderr
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", "x", "--attentions", "sdpa,nope"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--attentions 'sdpa,nope': use some of sdpa," in r.stderr


def test_host_section_takes_host_config_and_ahead_only(tmp_path):
    """`--host-config run_slots=3 --host-ahead-only`: the host section runs that host (its JSON says so)
    and measures no run-ahead-off baseline."""
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(tmp_path), "--sections", "host",
                        "--host-config", "run_slots=3", "--host-ahead-only"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    host = json.loads((tmp_path / "gpu_suite.json").read_text())["host"]
    assert host["host_config"] == {"run_slots": 3} and host["run_slots"] == 3
    row = host["concurrency"]["4"]
    assert row["host_ahead_tokens_per_s"] > 0 and "host_no_ahead_tokens_per_s" not in row


def test_host_section_once_per_workers_value(tmp_path):
    """`--workers 0 2`: the host section runs in-process and with 2 instance workers, the same texts
    as the backend's own loop in both (item 6 of issue 49: the H200 compares 0 with auto)."""
    r = subprocess.run([sys.executable, "bench/gpu_suite.py", "--dry-run", "--out", str(tmp_path), "--sections", "host",
                        "--workers", "0", "2", "--host-ahead-only"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    host = json.loads((tmp_path / "gpu_suite.json").read_text())["host"]
    assert set(host["by_workers"]) == {"0", "2"}
    assert [host["by_workers"][w]["workers"] for w in ("0", "2")] == [0, 2]
    for w in ("0", "2"):
        for table in ("concurrency", "concurrency_long"):
            row = host["by_workers"][w][table]["4"]
            assert row["host_ahead_tokens_per_s"] > 0 and row["host_ahead_texts_equal_own"] == 1.0, (w, table, row)
    assert "## host tax by HostConfig.workers" in (tmp_path / "gpu_suite.md").read_text()
