"""`pie-run`: run one inferlet on an embedded host, or on a pie-serve server with `--server`.

The `--server` path imports neither torch nor wasmtime: the host is imported only to run embedded.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from host.cli.build import BuildError, resolve_inferlet, standard_inferlets
from host.cli.file_args import expand_file_arguments
from host.cli.options import add_host_options, host_config_from_args, split_inferlet_args
from host.events import TERMINAL_EVENTS, InstanceEvent, print_log
from host.levels import PRIORITY_MAX, PRIORITY_MIN, check_priority

if TYPE_CHECKING:
    from host import Host

__all__ = ["main", "EXIT_OK", "EXIT_ERROR", "EXIT_USAGE", "EXIT_ABORTED"]

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_ABORTED = 0, 1, 2, 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pie-run",
        description="Run an inferlet: a .wasm component, an inferlet source folder, or the name of a "
                    "standard inferlet (e.g. text_completion). Arguments after `--` go to the inferlet.",
        epilog='example: pie-run text_completion -- --prompt "What is the capital of France?"')
    p.add_argument("inferlet", help=".wasm file, source folder, or standard inferlet name")
    p.add_argument("--server", default=None, metavar="URL", help="run on a pie-serve server (ws://host:port)")
    p.add_argument("--token", default=os.environ.get("PIE_AUTH_TOKEN"), help="auth token for --server")
    p.add_argument("--priority", type=_priority, default=0,
                   help=f"the instance's priority, from {PRIORITY_MIN} to {PRIORITY_MAX}: lower runs sooner "
                        "when the host is full (default 0)")
    p.add_argument("--record", type=Path, default=None, metavar="FILE",
                   help="record every host call the inferlet makes and what it got back, written to FILE when "
                        "it ends: `pie-replay FILE` re-runs it without a model (docs/observability.md)")
    add_host_options(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log host activity to stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    """`pie-run`: exit 0 when the inferlet completes, non-zero with the reason on stderr otherwise."""
    own, inferlet_args = split_inferlet_args(sys.argv[1:] if argv is None else argv)
    opts = _parser().parse_args(own)
    logging.basicConfig(level=logging.INFO if opts.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        wasm_path = resolve_inferlet(opts.inferlet)
        inferlet_args = expand_file_arguments(opts.inferlet, inferlet_args)  # e.g. --schema FILE
    except (BuildError, FileNotFoundError, ValueError) as e:
        print(f"pie-run: {e}", file=sys.stderr)
        return EXIT_USAGE
    if opts.server:
        from host.client.remote import run_remote

        return run_remote(opts.server, Path(wasm_path), inferlet_args, token=opts.token, stdin_lines=sys.stdin,
                          priority=opts.priority, record=opts.record, program_name=_standard_name(opts.inferlet))
    return _run_embedded(opts, Path(wasm_path), inferlet_args)


def _priority(text: str) -> int:
    """--priority's value, checked (argparse reports the error as a usage error naming it)."""
    try:
        return check_priority(int(text), "--priority")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e) if "--priority" in str(e) else
                                         f"--priority must be an integer, got {text!r}") from None


def _run_embedded(opts: argparse.Namespace, wasm_path: Path, args: list[str]) -> int:
    from host import CompileError, Host

    try:
        config = host_config_from_args(opts)
        if opts.workers is None and config.workers == "auto":
            # one instance: workers only add their start (~1 s here, measured with `make run`)
            config = dataclasses.replace(config, workers=0)
    except ValueError as e:
        print(f"pie-run: {e}", file=sys.stderr)
        return EXIT_USAGE
    from gpu_backend.engine.client import EngineDied

    try:
        host = Host(config)
    except (FileNotFoundError, ValueError) as e:
        print(f"pie-run: cannot load the model: {e}", file=sys.stderr)
        return EXIT_ERROR
    except EngineDied as e:
        print(f"pie-run: {e}", file=sys.stderr)
        return EXIT_ERROR
    with host:
        try:
            program = host.compile(wasm_path.read_bytes())
        except CompileError as e:
            print(f"pie-run: {wasm_path} is not a valid inferlet component: {e}", file=sys.stderr)
            return EXIT_ERROR
        end = _stream(host, program, args, opts.priority, record=opts.record is not None)
        if end is not None and opts.record is not None:
            from host.replay.format import save

            data = host.recording(end.instance_id) or b""
            print(save(opts.record, data, _standard_name(opts.inferlet)), file=sys.stderr)
    if end is None:
        return EXIT_ABORTED
    if end.event == "completed":
        if end.message:
            print(end.message, flush=True)
        return EXIT_OK
    print(f"pie-run: inferlet {end.event}: {end.message}", file=sys.stderr)
    return EXIT_ABORTED if end.event == "aborted" else EXIT_ERROR


def _standard_name(inferlet: str) -> str | None:
    """The standard inferlet's name `inferlet` is (kept in a recording: pie-replay builds it), else None."""
    return inferlet if inferlet in standard_inferlets() and not Path(inferlet).exists() else None


def _stream(host: Host, program: str, args: list[str], priority: int = 0,
            record: bool = False) -> InstanceEvent | None:
    """Launch, feed it stdin and print its messages; its terminal event, or None after Ctrl-C."""
    events: queue.Queue[InstanceEvent] = queue.Queue()
    iid = host.launch(program, args, events.put, priority=priority, record=record)
    threading.Thread(target=_pump_stdin, daemon=True,
                     args=(lambda m: host.signal(iid, m), lambda: host.close_input(iid))).start()
    try:
        while (ev := events.get()).event not in TERMINAL_EVENTS:
            if ev.event == "message":
                print(ev.message, flush=True)
            elif ev.event == "log":  # the guest's runtime.log, stdout and stderr: on stderr, marked
                print_log(ev)
        return ev
    except KeyboardInterrupt:
        host.terminate(iid, "interrupted (Ctrl-C)")
        print("pie-run: interrupted", file=sys.stderr)
        return None


def _pump_stdin(send: Callable[[str], None], close: Callable[[], None]) -> None:
    """Forward stdin lines to the instance; at EOF tell it no more input will come."""
    try:
        for line in sys.stdin:
            send(line.rstrip("\n"))
    except (OSError, ValueError):
        pass  # stdin closed or unreadable: same as EOF
    close()


if __name__ == "__main__":
    sys.exit(main())
