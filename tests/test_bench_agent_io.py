"""bench/agent_io.py end to end in its small mode (`--quick`): both ways of every agent kind run on
the real model (the inferlet with its outbound HTTP, in-sandbox code and child peer; the OpenAI
client against the endpoint), and the JSON has the documented shape. The numbers are not checked
against the targets (a few seconds of work measure nothing), only that they are there and positive,
and that both ways did the same I/O and LLM work per agent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.build]  # the real model; a componentize-py build


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("agent_io") / "agent_io.json"
    r = subprocess.run([sys.executable, "bench/agent_io.py", "--quick", "--json", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "| kind | ios |" in r.stdout  # the table
    return json.loads(out.read_text())


def test_top_level_keys(result: dict[str, Any]) -> None:
    assert {"config", "results", "targets", "machine", "commit"} <= set(result)
    cfg = result["config"]
    assert cfg["kinds"] == ["react", "codeact", "swarm"] and cfg["ios"] == [2] and cfg["agents"] == [1, 2]
    assert cfg["tokens"] == 4 and cfg["quick"] is True
    assert result["machine"]["cpus"] >= 1


def test_every_cell_has_both_ways(result: dict[str, Any]) -> None:
    cells = {(r["kind"], r["ios"], r["tool_ms"], r["agents"]) for r in result["results"]}
    assert cells == {(k, 2, 0.0, n) for k in ("react", "codeact", "swarm") for n in (1, 2)}
    for r in result["results"]:
        for way in ("inferlet", "client"):
            w = r[way]
            assert w["latency_s_median"] > 0 and w["agents_per_s"] > 0, (r["kind"], way, w)
            assert w["backend_tokens_per_agent"] > 0
        assert r["latency_ratio"] == pytest.approx(r["client"]["latency_s_median"] / r["inferlet"]["latency_s_median"])
        assert r["throughput_ratio"] == pytest.approx(r["inferlet"]["agents_per_s"] / r["client"]["agents_per_s"])
        assert r["latency_ratio"] > 0 and r["throughput_ratio"] > 0


def test_both_ways_do_the_same_work(result: dict[str, Any]) -> None:
    for r in result["results"]:
        inferlet, client = r["inferlet"], r["client"]
        assert inferlet["ios_done"] == client["ios_done"] == r["ios"], r
        # the same generations of the same length (greedy, max_tokens T, the same prompts; the swarm's
        # peer replies counted too): 3 generations of <= 4 tokens per agent, 3 more for a swarm's peer
        most = (r["ios"] + 1) * 4 + (r["ios"] * 4 if r["kind"] == "swarm" else 0)
        assert 0 < inferlet["completion_tokens_per_agent"] <= most
        assert 0 < client["completion_tokens_per_agent"] <= most


def test_targets(result: dict[str, Any]) -> None:
    targets = result["targets"]
    at = targets["ios_2"]  # --quick sweeps ios 2 only: the targets are read there
    assert at["ios"] == 2 and at["latency_ratio_min"] > 0 and at["throughput_ratio_min"] > 0
    assert at["latency_ratio_target"] == 1.15 and at["throughput_ratio_target"] == 1.3
    assert isinstance(at["met"], bool)
    assert set(targets["trend"]) == {f"{k}/tool_ms=0/agents={n}" for k in ("react", "codeact", "swarm") for n in (1, 2)}


def test_stand_in_regime_runs_both_ways_with_the_same_work(tmp_path: Path) -> None:
    """`--stand-in`: the same sweep behind the stand-in backend (a GPU's regime: 2 ms a batch), the
    backend named in the config, both ways doing the same I/Os and the same generations."""
    out = tmp_path / "agent_io_standin.json"
    r = subprocess.run([sys.executable, "bench/agent_io.py", "--quick", "--stand-in", "--kinds", "react,swarm",
                        "--agents", "1", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["config"]["stand_in"] == {"step_ms": 2.0, "token_us": 10.0}
    assert doc["config"]["model"] == "stand-in"
    assert {(x["kind"], x["agents"]) for x in doc["results"]} == {("react", 1), ("swarm", 1)}
    for x in doc["results"]:
        assert x["inferlet"]["ios_done"] == x["client"]["ios_done"] == 2
        assert x["inferlet"]["completion_tokens_per_agent"] == x["client"]["completion_tokens_per_agent"] > 0
