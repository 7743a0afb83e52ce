"""`pie-serve` options and the real command as a subprocess."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import wasm_bytes

from host.cli.options import host_config_from_args
from host.cli.serve import main as serve_main
from host.cli.serve import parse_args, server_config_from_args
from host.client import SyncPieClient


def test_options_map_to_host_config(tmp_path) -> None:
    args = parse_args(["--port", "0", "--kv-memory", "64", "--policy", "k-or-t", "--max-batch-tokens", "512",
                       "--memory-limit-mb", "128", "--wall-budget-s", "30", "--max-pages-per-instance", "8",
                       "--page-size", "32", "--data-dir", str(tmp_path)])
    cfg = host_config_from_args(args)
    assert (cfg.kv_memory_bytes, cfg.policy, cfg.max_batch_tokens, cfg.memory_limit_bytes) == \
        (64 * 2**20, "k-or-t", 512, 128 * 2**20)
    assert (cfg.wall_budget_s, cfg.max_pages_per_instance, cfg.page_size, cfg.data_dir) == (30.0, 8, 32, tmp_path)
    assert host_config_from_args(parse_args(["--num-pages", "100"])).num_pages == 100
    cfg = host_config_from_args(parse_args(["--swap-memory", "128", "--launch-queue", "5", "--launch-queue-timeout-s",
                                            "2.5", "--gpu-memory-utilization", "0.5"]))
    assert (cfg.swap_memory_bytes, cfg.launch_queue, cfg.launch_queue_timeout_s, cfg.gpu_memory_utilization) == \
        (128 * 2**20, 5, 2.5, 0.5)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        host_config_from_args(parse_args(["--gpu-memory-utilization", "1.5"]))


def test_bound_flags_map_to_server_config_with_per_tenant_defaults(tmp_path) -> None:
    cfg = server_config_from_args(parse_args([
        "--max-queued-mb", "2", "--max-uploads-mb", "64", "--max-body-mb", "0.5", "--max-connections", "10",
        "--max-connections-per-tenant", "3", "--auth-timeout-s", "2", "--read-timeout-s", "4",
        "--write-timeout-s", "6", "--max-store-mb", "100", "--program-ttl-h", "2", "--max-instances-per-tenant", "7"]))
    assert (cfg.max_queued_bytes, cfg.max_upload_bytes_in_flight, cfg.max_body_bytes) == (2 * 2**20, 64 * 2**20, 2**19)
    assert (cfg.max_connections, cfg.max_connections_per_tenant, cfg.auth_timeout_s, cfg.read_timeout_s,
            cfg.write_timeout_s) == (10, 3, 2.0, 4.0, 6.0)
    assert (cfg.max_store_bytes_per_tenant, cfg.program_ttl_s, cfg.max_instances_per_tenant) == \
        (100 * 2**20, 7200.0, 7)
    assert cfg.tenant_connection_cap == 10  # one identity: nobody to share with
    single = server_config_from_args(parse_args(["--auth-token", "t"]))
    assert single.max_instances_per_tenant is None
    shared = server_config_from_args(parse_args(["--auth-token", "t", "--tenant", "a=x", "--max-instances", "40"]))
    assert (shared.max_instances_per_tenant, shared.tenant_connection_cap) == (20, 256)
    assert server_config_from_args(parse_args(["--tenant", "a=x", "--tenant", "b=y",
                                               "--max-instances-per-tenant", "0"])).max_instances_per_tenant is None
    assert serve_main(["--tenant", "../x=tok"]) == 2  # a tenant name that could leave the store's directory
    cfg2 = host_config_from_args(parse_args(["--max-pages-per-tenant", "9", "--max-inbox-kb", "64"]))
    assert (cfg2.max_pages_per_tenant, cfg2.max_inbox_bytes) == (9, 64 * 1024)


def test_options_map_to_server_config(tmp_path) -> None:
    cfg = server_config_from_args(parse_args(["--host", "0.0.0.0", "--port", "0", "--auth-token", "",
                                              "--data-dir", str(tmp_path), "--max-program-mb", "3"]))
    assert (cfg.host, cfg.port, cfg.auth_token, cfg.data_dir, cfg.max_program_bytes) == \
        ("0.0.0.0", 0, None, tmp_path, 3 * 2**20)


def test_token_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("PIE_AUTH_TOKEN", "from-env")
    assert parse_args([]).auth_token == "from-env"


def test_bad_options_are_reported(capsys) -> None:
    assert serve_main(["--max-batch-tokens", "0"]) == 2
    assert "max_batch_tokens must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--num-pages", "10", "--kv-memory", "10"])


@pytest.mark.slow
def test_a_bad_warm_start_inferlet_is_reported(capsys, tmp_path) -> None:
    argv = ["--warm-start", "no_such_inferlet", "--openai-handler", "none", "--port", "0", "--data-dir", str(tmp_path)]
    assert serve_main(argv) == 2
    err = capsys.readouterr().err
    assert "--warm-start" in err and "no_such_inferlet" in err


def test_warm_start_defaults_to_text_completion() -> None:
    assert parse_args([]).warm_start == ["text_completion"]
    assert parse_args(["--warm-start", "none"]).warm_start == ["none"]
    assert parse_args([]).warm_start_instances == 16  # a few, cheap at start-up; warm_auto learns bursts
    assert parse_args(["--warm-start-instances", "16"]).warm_start_instances == 16


def test_a_negative_warm_start_count_is_a_usage_error(capsys) -> None:
    assert serve_main(["--warm-start-instances", "-1"]) == 2
    assert "--warm-start-instances must be >= 0" in capsys.readouterr().err


def test_bad_openai_handler_is_reported_before_the_model_loads(capsys) -> None:
    assert serve_main(["--openai-handler", "no_such_inferlet"]) == 2
    err = capsys.readouterr().err
    assert "--openai-handler" in err and "no_such_inferlet" in err


def _drain(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    """pie-serve's stderr lines as they come ("" at its end), read on a thread so the pipe never fills."""
    lines: queue.Queue[str] = queue.Queue()
    stderr = proc.stderr
    assert stderr is not None

    def pump() -> None:
        for line in stderr:
            lines.put(line)
        lines.put("")

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.mark.slow
@pytest.mark.build
def test_pie_serve_subprocess_serves_and_stops_on_sigterm(tmp_path) -> None:
    env = dict(os.environ, PIE_AUTH_TOKEN="tok")
    handler = Path(__file__).parent / "fixtures" / "openai_upper"  # a custom OpenAI handler, as a source folder
    proc = subprocess.Popen([sys.executable, "-m", "host.cli.serve", "--port", "0", "--data-dir", str(tmp_path),
                             "--num-pages", "256", "--openai-handler", str(handler),
                             "--served-model-name", "upper"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = _drain(proc)
        url = None
        while url is None:
            line = lines.get(timeout=120)
            assert line, "pie-serve exited before listening"
            if m := re.search(r"listening on (ws://\S+)", line):
                url = m.group(1)
        with SyncPieClient(url, token="tok") as client:
            h = client.ensure_program(wasm_bytes("text_completion"))
            iid = client.launch(h, ["--prompt", "What is the capital of France?", "--max-tokens", "12"])
            events = list(client.events(iid))
            assert events[-1].event == "completed" and "Paris" in events[-1].message
            assert client.query("stats")["host"]["total_pages"] == 256
        import openai

        oa = openai.OpenAI(base_url=url.replace("ws://", "http://") + "/v1", api_key="tok", max_retries=0)
        assert [m.id for m in oa.models.list().data] == ["upper"]
        r = oa.completions.create(model="upper", prompt="shout this", n=2)
        assert [c.text for c in r.choices] == ["SHOUT THIS", "SHOUT THIS"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert (tmp_path / "programs" / f"{h}.wasm").is_file()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_outbound_flags_map_to_host_config(capsys) -> None:
    cfg = host_config_from_args(parse_args([
        "--http-allow", "api.example.com", "--http-allow", "10.0.0.0/8:8080", "--tenant-http-allow",
        "alice=*.alice.test", "--http-max-response-kb", "64", "--http-timeout-s", "5", "--http-max-per-tenant", "3",
        "--max-child-depth", "2", "--max-children", "5", "--allow-detached-children"]))
    assert cfg.http_allow == ("api.example.com", "10.0.0.0/8:8080")
    assert cfg.http_tenant_allow == (("alice", "*.alice.test"),)
    assert (cfg.http_limits.max_response_bytes, cfg.http_limits.timeout_s, cfg.http_limits.per_tenant) == \
        (64 * 1024, 5.0, 3)
    assert (cfg.child_limits.max_depth, cfg.child_limits.per_parent, cfg.child_limits.allow_detached) == (2, 5, True)
    assert host_config_from_args(parse_args([])).http_allow == ()  # no outbound HTTP unless allowed
    assert serve_main(["--http-allow", "http://api.example.com/"]) == 2
    assert "give a host, not a URL" in capsys.readouterr().err
    assert serve_main(["--http-timeout-s", "0"]) == 2
    assert "timeout_s must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--tenant-http-allow", "nopattern"])
