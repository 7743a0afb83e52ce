"""`pie-serve` options and the real command as a subprocess."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wasm_bytes

from host.client import SyncPieClient
from host.server import _parse_args, host_config_from_args, serve_main

ROOT = Path(__file__).resolve().parents[1]


def test_options_map_to_host_config(tmp_path) -> None:
    args = _parse_args(["--port", "0", "--kv-memory", "64", "--policy", "k-or-t", "--max-batch-tokens", "512",
                        "--memory-limit-mb", "128", "--wall-budget-s", "30", "--max-pages-per-instance", "8",
                        "--page-size", "32", "--data-dir", str(tmp_path)])
    cfg = host_config_from_args(args)
    assert (cfg.kv_memory_bytes, cfg.policy, cfg.max_batch_tokens, cfg.memory_limit_bytes) == \
        (64 * 2**20, "k-or-t", 512, 128 * 2**20)
    assert (cfg.wall_budget_s, cfg.max_pages_per_instance, cfg.page_size, cfg.data_dir) == (30.0, 8, 32, tmp_path)
    assert host_config_from_args(_parse_args(["--num-pages", "100"])).num_pages == 100


def test_token_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("PIE_AUTH_TOKEN", "from-env")
    assert _parse_args([]).auth_token == "from-env"


def test_bad_options_are_reported(capsys) -> None:
    assert serve_main(["--max-batch-tokens", "0"]) == 2
    assert "max_batch_tokens must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--num-pages", "10", "--kv-memory", "10"])


@pytest.mark.slow
def test_pie_serve_subprocess_serves_and_stops_on_sigterm(tmp_path) -> None:
    env = dict(os.environ, PIE_AUTH_TOKEN="tok")
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from host.server import serve_main; "
                             "sys.exit(serve_main(sys.argv[1:]))", "--port", "0", "--data-dir", str(tmp_path),
                             "--num-pages", "256"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stderr.readline()
            assert line, "pie-serve exited before listening"
            if m := re.search(r"listening on (ws://\S+)", line):
                url = m.group(1)
        assert url is not None
        with SyncPieClient(url, token="tok") as client:
            h = client.ensure_program(wasm_bytes("text_completion"))
            iid = client.launch(h, ["--prompt", "What is the capital of France?", "--max-tokens", "12"])
            events = list(client.events(iid))
            assert events[-1].event == "completed" and "Paris" in events[-1].message
            assert client.query("stats")["host"]["total_pages"] == 256
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert (tmp_path / "programs" / f"{h}.wasm").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()
