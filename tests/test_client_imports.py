"""A client-only process stays light: `import host.client` and `pie-run --server` load neither
torch nor wasmtime (nor tiktoken, jinja2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from server_support import WASM

HEAVY = ("torch", "wasmtime", "tiktoken", "jinja2")


def test_import_host_client_loads_nothing_heavy() -> None:
    code = ("import sys, host.client, host.client.protocol; "
            f"loaded = sorted({set(HEAVY)!r} & set(sys.modules)); "
            "assert not loaded, f'host.client imported {loaded}'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def _pie_run() -> list[str]:
    """The installed pie-run entry script, run by this interpreter; else `python -m host.cli`."""
    script = Path(sys.executable).with_name("pie-run")
    return [sys.executable, "-X", "importtime", *([str(script)] if script.is_file() else ["-m", "host.cli"])]


def _imported(importtime_log: str) -> set[str]:
    """Top-level names of the modules `python -X importtime` reported importing."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


def test_pie_run_server_loads_nothing_heavy(tmp_path: Path) -> None:
    wasm = tmp_path / "app.wasm"
    wasm.write_bytes(WASM)
    res = subprocess.run([*_pie_run(), "--server", "ws://127.0.0.1:1", str(wasm), "--", "--prompt", "hi"],
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and "pie-run: cannot connect to ws://127.0.0.1:1" in res.stderr, res.stderr
    imported = _imported(res.stderr)
    assert {"host", "websockets", "msgpack"} <= imported  # the audit sees the client path
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
