"""Command-line entry points: `pie-run` (embedded host or a server) and `pie-serve`."""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from host.instance import TERMINAL_EVENTS, InstanceEvent

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ABORTED = 0, 1, 2, 130


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pie-run",
        description="Run an inferlet: a .wasm component, an inferlet source folder, or the name of a "
                    "standard inferlet (e.g. text_completion). Arguments after `--` go to the inferlet.",
        epilog='example: pie-run text_completion -- --prompt "What is the capital of France?"')
    p.add_argument("inferlet", help=".wasm file, source folder, or standard inferlet name")
    p.add_argument("--model", default=None, help="GGUF file or HF safetensors dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--server", default=None, metavar="URL", help="run on a pie-serve server (ws://host:port)")
    p.add_argument("--token", default=os.environ.get("PIE_AUTH_TOKEN"), help="auth token for --server")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="weights/KV dtype (default: float32 on CPU, bfloat16 on CUDA; bfloat16 is ~2x faster on CPUs with bf16)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--num-pages", type=int, default=None, help="KV pages (default: from a 256 MiB budget)")
    p.add_argument("--wall-budget-s", type=float, default=None, help="wall-clock limit for the instance")
    p.add_argument("--memory-limit-mb", type=int, default=512, help="linear memory limit (default 512 MiB)")
    p.add_argument("-v", "--verbose", action="store_true", help="log host activity to stderr")
    return p


def _split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def _pump_stdin(send: Callable[[str], None], close: Callable[[], None]) -> None:
    """Forward stdin lines to the instance; at EOF tell it no more input will come."""
    try:
        for line in sys.stdin:
            send(line.rstrip("\n"))
    except (OSError, ValueError):
        pass  # stdin closed or unreadable: same as EOF
    close()


def run_main(argv: list[str] | None = None) -> int:
    """`pie-run`: exit 0 when the inferlet completes, non-zero with the reason on stderr otherwise."""
    own, inferlet_args = _split_args(list(sys.argv[1:] if argv is None else argv))
    parser = _run_parser()
    opts = parser.parse_args(own)
    logging.basicConfig(level=logging.INFO if opts.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from host.build import BuildError, resolve_inferlet

    try:
        wasm_path = resolve_inferlet(opts.inferlet)
    except (BuildError, FileNotFoundError, ValueError) as e:
        print(f"pie-run: {e}", file=sys.stderr)
        return EXIT_USAGE
    if opts.server:
        from host.client import run_remote

        return run_remote(opts.server, Path(wasm_path), inferlet_args, token=opts.token,
                          stdin_lines=sys.stdin)
    return _run_embedded(opts, Path(wasm_path), inferlet_args)


def _run_embedded(opts: argparse.Namespace, wasm_path: Path, args: list[str]) -> int:
    from host.config import HostConfig
    from host.engine import CompileError
    from host.runtime import Host

    try:
        config = HostConfig(model=opts.model, device=opts.device, dtype=opts.dtype, page_size=opts.page_size,
                            num_pages=opts.num_pages, wall_budget_s=opts.wall_budget_s,
                            memory_limit_bytes=opts.memory_limit_mb * 2**20)
    except ValueError as e:
        print(f"pie-run: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        host = Host(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"pie-run: cannot load the model: {e}", file=sys.stderr)
        return EXIT_ERROR
    events: queue.Queue[InstanceEvent] = queue.Queue()
    with host:
        try:
            program = host.compile(wasm_path.read_bytes())
        except CompileError as e:
            print(f"pie-run: {wasm_path} is not a valid inferlet component: {e}", file=sys.stderr)
            return EXIT_ERROR
        iid = host.launch(program, args, events.put)
        threading.Thread(target=_pump_stdin, daemon=True,
                         args=(lambda m: host.signal(iid, m), lambda: host.close_input(iid))).start()
        try:
            while True:
                ev = events.get()
                if ev.event == "message":
                    print(ev.message, flush=True)
                elif ev.event in TERMINAL_EVENTS:
                    break
        except KeyboardInterrupt:
            host.terminate(iid, "interrupted (Ctrl-C)")
            print("pie-run: interrupted", file=sys.stderr)
            return EXIT_ABORTED
    if ev.event == "completed":
        if ev.message:
            print(ev.message, flush=True)
        return EXIT_OK
    print(f"pie-run: inferlet {ev.event}: {ev.message}", file=sys.stderr)
    return EXIT_ABORTED if ev.event == "aborted" else EXIT_ERROR


def serve_main(argv: list[str] | None = None) -> int:
    """`pie-serve`: the WebSocket server (see host/server.py)."""
    from host.server import serve_main as _serve

    return _serve(argv)


if __name__ == "__main__":
    sys.exit(run_main())
