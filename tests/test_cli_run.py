"""`pie-run`'s options (shared with pie-serve) and its usage errors; the full runs are in test_host_e2e."""

from __future__ import annotations

import argparse

import pytest

from host.cli import run, serve
from host.cli.options import add_host_options, host_config_from_args, split_inferlet_args
from host.config import HostConfig


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def test_pie_run_and_pie_serve_take_the_same_host_flags() -> None:
    shared = argparse.ArgumentParser()
    add_host_options(shared)
    host_flags = _flags(shared) - {"-h", "--help"}
    assert "--memory-limit-mb" in host_flags and "--kv-memory" in host_flags
    assert host_flags <= _flags(run._parser()) & _flags(serve._parser())
    args = serve.parse_args(["--page-size", "32", "--memory-limit-mb", "64", "--policy", "k-or-t"])
    assert host_config_from_args(args) == HostConfig(page_size=32, memory_limit_bytes=64 * 2**20, policy="k-or-t",
                                                     data_dir=args.data_dir)


def test_pie_run_options_map_to_host_config() -> None:
    opts = run._parser().parse_args(["app.wasm", "--device", "cpu", "--dtype", "bfloat16", "--num-pages", "64",
                                     "--wall-budget-s", "2.5", "--memory-limit-mb", "128"])
    cfg = host_config_from_args(opts)
    assert (cfg.device, cfg.dtype, cfg.num_pages, cfg.wall_budget_s, cfg.memory_limit_bytes) == \
        ("cpu", "bfloat16", 64, 2.5, 128 * 2**20)
    assert host_config_from_args(run._parser().parse_args(["app.wasm"])) == HostConfig()  # defaults untouched
    assert host_config_from_args(run._parser().parse_args(["app.wasm", "--switch-interval-ms", "0"])).switch_interval_ms == 0


def test_inferlet_arguments_follow_a_double_dash() -> None:
    assert split_inferlet_args(["x", "-v", "--", "--prompt", "--", "hi"]) == (["x", "-v"], ["--prompt", "--", "hi"])
    assert split_inferlet_args(["x"]) == (["x"], [])


def test_unknown_inferlet_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["no_such_inferlet"]) == run.EXIT_USAGE
    err = capsys.readouterr().err
    assert "pie-run: 'no_such_inferlet' is not a .wasm file" in err and "text_completion" in err


def test_bad_host_option_is_a_usage_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    wasm = tmp_path / "app.wasm"
    wasm.write_bytes(b"\0asm")
    assert run.main([str(wasm), "--max-batch-tokens", "0"]) == run.EXIT_USAGE
    assert "pie-run: max_batch_tokens must be >= 1, got 0" in capsys.readouterr().err


@pytest.mark.heavy  # (~2-8 s; make test runs it)
def test_a_device_that_is_not_there_is_a_clear_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """No traceback: an absent GPU, a bad device string or more ranks than GPUs name the problem."""
    wasm = tmp_path / "app.wasm"
    wasm.write_bytes(b"\0asm")
    assert run.main([str(wasm), "--device", "cuda:99"]) == run.EXIT_ERROR
    err = capsys.readouterr().err
    assert "pie-run: cannot load the model: device 'cuda:99'" in err and "Traceback" not in err
    assert run.main([str(wasm), "--device", "gpu0"]) == run.EXIT_ERROR
    assert "'gpu0' is not a torch device: use cpu, cuda or cuda:N" in capsys.readouterr().err
    assert run.main([str(wasm), "--device", "cuda", "--tp", "99"]) == run.EXIT_ERROR
    err = capsys.readouterr().err
    assert "needs 99 GPUs" in err or "no CUDA GPU is visible" in err
    assert serve.main(["--device", "cuda:99", "--port", "0", "--openai-handler", "none"]) == serve.EXIT_ERROR
    assert "pie-serve: cannot load the model: device 'cuda:99'" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "env", "want"), [([], "auto", 0), (["--workers", "auto"], "0", "auto"),
                                                    (["--workers", "3"], "auto", 3), ([], "2", 2)])
def test_pie_run_takes_no_workers_for_auto_unless_asked(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                        flags: list[str], env: str, want: object) -> None:
    """pie-run runs one instance: `auto` (the default) means in-process there, unless --workers says."""
    import host

    seen: list[HostConfig] = []

    def fake_host(config: HostConfig) -> None:
        seen.append(config)
        raise ValueError("stop here")

    monkeypatch.setenv("PIE_WORKERS", env)
    monkeypatch.setattr(host, "Host", fake_host)
    wasm = tmp_path / "x.wasm"
    wasm.write_bytes(b"\0asm")
    assert run.main([*flags, str(wasm)]) == run.EXIT_ERROR
    assert len(seen) == 1 and seen[0].workers == want
