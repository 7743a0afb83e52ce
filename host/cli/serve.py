"""`pie-serve`: load the host and serve, on one port, protocol v1 over WebSocket and the
OpenAI-compatible HTTP routes (with /health and /metrics) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from host.cli.build import BuildError, resolve_inferlet
from host.cli.options import add_host_options, host_config_from_args
from host.client.protocol import MAX_FRAME_BYTES
from host.config import default_data_dir
from host.server import Server, ServerConfig
from host.server.programs import DEFAULT_MAX_PROGRAM_BYTES

__all__ = ["main", "parse_args", "server_config_from_args"]

EXIT_ERROR, EXIT_USAGE = 1, 2
DEFAULT_OPENAI_HANDLER = "openai_chat"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """pie-serve's arguments: where to listen, the host flags, the program store and limits."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pie-serve",
        description="Serve inferlets on one port: WebSocket protocol v1 (docs/protocol.md), the OpenAI-compatible "
                    "routes /v1/chat/completions, /v1/completions, /v1/models (docs/openai.md), /health and /metrics.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (0 picks a free one; default 8080)")
    ap.add_argument("--auth-token", default=os.environ.get("PIE_AUTH_TOKEN"),
                    help="require this token (default: $PIE_AUTH_TOKEN; none = no authentication)")
    ap.add_argument("--tenant", action="append", default=[], metavar="NAME=TOKEN", type=_tenant,
                    help="another client identity with its own token (repeatable); each tenant sees only "
                         "its own KV exports")
    ap.add_argument("--openai-handler", default=DEFAULT_OPENAI_HANDLER, metavar="PATH_OR_NAME",
                    help="the inferlet that answers the OpenAI routes: a .wasm, an inferlet source folder or a "
                         f"standard inferlet name, like pie-run's INFERLET (default {DEFAULT_OPENAI_HANDLER}; "
                         "'none' serves no OpenAI routes)")
    ap.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model name the OpenAI routes answer to and /v1/models lists (default: the model's own)")
    add_host_options(ap)
    ap.add_argument("--data-dir", type=Path, default=default_data_dir(),
                    help="program store and key-value store (default: $PIE_DATA_DIR or the host cache dir)")
    ap.add_argument("--max-frame-bytes", type=int, default=MAX_FRAME_BYTES,
                    help=f"largest accepted WebSocket frame (default {MAX_FRAME_BYTES})")
    ap.add_argument("--max-program-mb", type=int, default=DEFAULT_MAX_PROGRAM_BYTES // 2**20,
                    help=f"largest accepted program (default {DEFAULT_MAX_PROGRAM_BYTES // 2**20} MiB)")
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return ap


def _tenant(value: str) -> tuple[str, str]:
    name, sep, token = value.partition("=")
    if not sep or not name or not token:
        raise argparse.ArgumentTypeError(f"expected NAME=TOKEN, got {value!r}")
    return name, token


def server_config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The `ServerConfig` for parsed pie-serve arguments (an empty token means none)."""
    return ServerConfig(host=args.host, port=args.port, auth_token=args.auth_token or None,
                        tenants=tuple(args.tenant),
                        data_dir=args.data_dir, max_frame_bytes=args.max_frame_bytes,
                        max_program_bytes=args.max_program_mb * 2**20)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `pie-serve`: load the host and serve until SIGINT/SIGTERM."""
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from host import Host

    try:
        config = host_config_from_args(args)
        server_config = server_config_from_args(args)
    except ValueError as exc:
        print(f"pie-serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    handler_wasm = None
    if args.openai_handler != "none":
        try:  # before the model loads: a bad handler fails at once
            handler_wasm = resolve_inferlet(args.openai_handler, quiet=True).read_bytes()
        except (BuildError, OSError) as exc:
            print(f"pie-serve: --openai-handler: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from gpu_backend.engine.client import EngineDied

    try:
        host = Host(config)
    except (FileNotFoundError, ValueError, EngineDied) as exc:
        print(f"pie-serve: cannot load the model: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        program = host.compile(handler_wasm) if handler_wasm is not None else None
        server = Server(host, server_config, openai_program=program, model_name=args.served_model_name)
    except Exception:
        host.shutdown()
        raise

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_stop)
        await server.serve_forever()

    try:
        asyncio.run(serve())
    finally:
        host.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
