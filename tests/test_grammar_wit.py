"""Structured generation through the WIT on the real model: inferlets drive `grammar` / `matcher` resources
and the constrained forward calls; the host fills every mask and advances every matcher.

The runs of one case are launched together, so they share batches (the host loop keeps them all
resident); each samples at temperature 1 with its own seed. Also the pie-run path with --schema FILE.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from helpers import Run, wasm_bytes
from test_grammar_e2e import REGEXES, SCHEMAS

from host import Host

pytestmark = pytest.mark.slow

RUNS = 20


@pytest.fixture(scope="module")
def host(real_host: Host) -> Host:
    return real_host


@pytest.fixture(scope="module")
def probe(host: Host) -> str:
    return host.compile(wasm_bytes("grammar_probe"))


@pytest.fixture(scope="module")
def cjson(host: Host) -> str:
    return host.compile(wasm_bytes("constrained_json"))


def results(host: Host, prog: str, arg_lists: list[list[str]], timeout: float = 300) -> list[dict]:
    """Launch every run at once, then collect their JSON results in order."""
    runs = [Run(host, prog, args) for args in arg_lists]
    out = []
    for r in runs:
        ev = r.finish(timeout)
        assert ev.event == "completed", ev.message
        out.append(json.loads(ev.message))
    return out


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_sampled_json_validates_against_its_schema(host, cjson, name) -> None:  # noqa: ANN001
    schema = json.dumps(SCHEMAS[name])
    outs = results(host, cjson, [["--schema", schema, "--temperature", "1", "--top-k", "0", "--seed", str(s),
                                  "--max-tokens", "60", "--json"] for s in range(RUNS)])
    for i, o in enumerate(outs):
        assert o["complete"] and o["forced_suffix"] == "", (i, o)
        jsonschema.validate(json.loads(o["text"]), SCHEMAS[name])
    assert len({o["text"] for o in outs}) > 1  # temperature 1: the runs differ


@pytest.mark.parametrize("pattern", REGEXES)
def test_sampled_text_fullmatches_its_regex_on_both_paths(host, probe, pattern) -> None:  # noqa: ANN001
    args = [["gen", "regex", pattern, "--seed", str(s), "--max-tokens", "30", "--prompt",
             f"Write text matching {pattern}", "--path", "here" if s % 2 else "host"] for s in range(RUNS)]
    for i, o in enumerate(results(host, probe, args)):
        assert o.get("complete") and re.fullmatch(pattern, o["text"]), (i, o)


def test_constrained_and_free_runs_together_get_what_they_get_alone(host, probe) -> None:  # noqa: ANN001
    schema = json.dumps(SCHEMAS["enum and ranges"])
    cases = [["gen", "json_schema", schema, "--seed", "3"], ["gen", "none", "", "--seed", "4"],
             ["gen", "regex", REGEXES[1], "--seed", "5", "--path", "here"], ["gen", "none", "", "--seed", "6",
                                                                             "--path", "here"]]
    cases = [[*c, "--max-tokens", "12", "--prompt", "Describe a T-shirt order."] for c in cases]
    together = results(host, probe, cases)
    alone = [results(host, probe, [c])[0] for c in cases]
    assert together == alone
    assert together[0]["text"] != together[1]["text"]


@pytest.mark.parametrize(("kind", "source", "message"), [
    ("json_schema", '{"type": "nonsense"}', "invalid JSON schema: .*nonsense"),
    ("regex", "([0-9]", r"invalid regex '\(\[0-9\]'.*unclosed group"),
    ("ebnf", "root ::= undefined_rule", "invalid EBNF grammar: .*undefined_rule"),
])
def test_a_bad_grammar_comes_back_as_an_error_naming_the_problem(host, probe, kind, source, message) -> None:  # noqa: ANN001
    (out,) = results(host, probe, [["compile", kind, source]])
    assert re.search(message, out["error"], re.S), out


@pytest.mark.parametrize("path", ["host", "here"])
def test_a_grammar_admitting_no_token_ends_with_a_clear_error(host, probe, path) -> None:  # noqa: ANN001
    nothing = "start: NOTHING\nNOTHING: /[a-z]+/ & /[0-9]+/"  # letters and digits at once
    (out,) = results(host, probe, [["gen", "lark", nothing, "--path", path]], timeout=60)
    assert "admits no token" in out["error"], out
    assert out["pending"] > 0  # the context is as before the call: its prompt still to run


def test_matcher_methods_through_the_wit(host, probe) -> None:  # noqa: ANN001
    (out,) = results(host, probe, [["matcher"]])
    assert out == {"accept_a_then_x": 1, "accepted": 1, "accept_b": 1, "twin_accepts_c": 1, "stop": 1,
                   "terminated": True, "after_rollback": [False, 2], "after_reset": 0, "refuses_b_at_start": 0}


def test_choice_picks_one_of_the_options(host, probe) -> None:  # noqa: ANN001
    options = ["red", "green", "light blue"]
    outs = results(host, probe, [["gen", "choice", json.dumps(options), "--seed", str(s), "--prompt",
                                  "Name a colour."] for s in range(6)])
    assert all(o["complete"] and o["text"] in options for o in outs), outs


def test_pie_run_constrained_json_with_a_schema_file(tmp_path: Path) -> None:
    schema = SCHEMAS["nested objects"]
    f = tmp_path / "schema.json"
    f.write_text(json.dumps(schema))
    exe = Path(sys.executable).with_name("pie-run")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "host.cli", "run"]
    proc = subprocess.run([*cmd, "constrained_json", "--", "--schema", str(f), "--temperature", "1", "--seed", "2",
                           "--max-tokens", "60"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    jsonschema.validate(json.loads(proc.stdout), schema)
