"""`pie-serve`: load the host and serve, on one port, protocol v1 over WebSocket and the
OpenAI-compatible HTTP routes (with /health and /metrics) until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from host.cli.build import BuildError, resolve_inferlet
from host.cli.options import add_host_options, host_config_from_args
from host.client.protocol import MAX_FRAME_BYTES
from host.config import HostConfig, default_data_dir
from host.server import Server, ServerConfig
from host.server.programs import DEFAULT_MAX_PROGRAM_BYTES

__all__ = ["main", "parse_args", "server_config_from_args"]

EXIT_ERROR, EXIT_USAGE = 1, 2
MIB = 2**20
DEFAULT_OPENAI_HANDLER = "openai_chat"
DEFAULT_EMBEDDING_HANDLER = "openai_embed"

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """pie-serve's arguments: where to listen, the host flags, the program store and limits."""
    return _parser().parse_args(argv)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="pie-serve",
        description="Serve inferlets on one port: WebSocket protocol v1 (docs/protocol.md), the OpenAI-compatible "
                    "routes /v1/chat/completions, /v1/completions, /v1/responses, /v1/embeddings, /v1/models "
                    "(docs/openai.md), /health and /metrics.")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    ap.add_argument("--port", type=int, default=8080, help="port (0 picks a free one; default 8080)")
    ap.add_argument("--auth-token", default=os.environ.get("PIE_AUTH_TOKEN"),
                    help="require this token (default: $PIE_AUTH_TOKEN; none = no authentication)")
    ap.add_argument("--tenant", action="append", default=[], metavar="NAME=TOKEN", type=_tenant,
                    help="another client identity with its own token (repeatable); each tenant sees only "
                         "its own instances, programs and KV exports (the --auth-token identity sees all)")
    ap.add_argument("--openai-handler", default=DEFAULT_OPENAI_HANDLER, metavar="PATH_OR_NAME",
                    help="the inferlet that answers the OpenAI routes: a .wasm, an inferlet source folder or a "
                         f"standard inferlet name, like pie-run's INFERLET (default {DEFAULT_OPENAI_HANDLER}; "
                         "'none' serves no OpenAI routes)")
    ap.add_argument("--embedding-handler", default=DEFAULT_EMBEDDING_HANDLER, metavar="PATH_OR_NAME",
                    help="the inferlet that answers POST /v1/embeddings, as --openai-handler (default "
                         f"{DEFAULT_EMBEDDING_HANDLER}: last-token pooling, normalized; 'none' serves no embeddings)")
    ap.add_argument("--max-image-mb", type=float, default=_server_default("max_image_bytes") / MIB,
                    help="largest image in a chat request (its encoded bytes; a data: URL also counts against "
                         "--max-body-mb); larger is a 400 (default %(default)g MiB)")
    ap.add_argument("--max-images", type=int, default=_server_default("max_images"),
                    help="images one chat request may carry; more is a 400 (default %(default)s)")
    ap.add_argument("--allow-remote-images", nargs="*", default=None, metavar="HOST[:PORT]",
                    help="fetch http(s) image URLs of chat requests (default: refused, 400; data: URLs only): "
                         "alone, from any host on a global address (never loopback, private or link-local); "
                         "with patterns, from those only (the forms of --http-allow)")
    ap.add_argument("--matryoshka", nargs="*", type=int, default=None, metavar="DIM",
                    help="the model was trained for Matryoshka embeddings: /v1/embeddings may cut a vector to "
                         "`dimensions` (alone: any width; with widths: those), as when its config.json has "
                         "is_matryoshka / matryoshka_dimensions (default: what config.json says; neither: "
                         "`dimensions` other than the full width is a 400)")
    ap.add_argument("--warm-start", nargs="+", default=["text_completion"], metavar="PATH_OR_NAME",
                    help="inferlets whose instances the host starts ahead of demand before it serves, together "
                         "with the OpenAI handler's, sharing --warm-auto: a fresh host's first burst then skips "
                         "the instances' start-up (default text_completion; 'none' warms nothing)")
    ap.add_argument("--warm-start-instances", type=int, default=16, metavar="N",
                    help="instances of each --warm-start inferlet started before serving (default 16); twice as "
                         "many pool slots are primed, each ~14 MB resident (256 of one: 512 slots, ~7 GB, ~9 s "
                         "here); bursts beyond it start cold until --warm-auto has learned their size")
    ap.add_argument("--served-model-name", default=None, metavar="NAME",
                    help="the model name the OpenAI routes answer to and /v1/models lists (default: the model's own)")
    add_host_options(ap)
    ap.add_argument("--data-dir", type=Path, default=default_data_dir(),
                    help="program store and key-value store (default: $PIE_DATA_DIR or the host cache dir)")
    ap.add_argument("--max-frame-bytes", type=int, default=MAX_FRAME_BYTES,
                    help=f"largest accepted WebSocket frame (default {MAX_FRAME_BYTES})")
    ap.add_argument("--max-program-mb", type=int, default=DEFAULT_MAX_PROGRAM_BYTES // 2**20,
                    help=f"largest accepted program (default {DEFAULT_MAX_PROGRAM_BYTES // 2**20} MiB)")
    _add_bounds(ap)
    ap.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return ap


def _server_default(name: str) -> Any:
    return next(f.default for f in dataclasses.fields(ServerConfig) if f.name == name)


def _add_bounds(ap: argparse.ArgumentParser) -> None:
    """The per-connection, per-tenant and per-server bounds (docs/protocol.md, "Bounds")."""
    mib = lambda name: _server_default(name) / MIB  # noqa: E731
    g = ap.add_argument_group("bounds", "what one connection, one tenant and the server may hold")
    g.add_argument("--max-queued-mb", type=float, default=mib("max_queued_bytes"),
                   help="bytes queued for one WebSocket client; a client that lets more pile up (does not read) "
                        "is disconnected (default %(default)g MiB)")
    g.add_argument("--max-uploads-mb", type=float, default=mib("max_upload_bytes_in_flight"),
                   help="bytes held by all partial uploads of the server together (each connection holds one "
                        "upload, at most --max-program-mb); a chunk past it is refused (default %(default)g MiB)")
    g.add_argument("--max-body-mb", type=float, default=mib("max_body_bytes"),
                   help="largest HTTP request body; larger is answered 413 before it is read (default %(default)g MiB)")
    g.add_argument("--max-connections", type=int, default=_server_default("max_connections"),
                   help="open connections of the server, HTTP and WebSocket; past it: 503 (default %(default)s)")
    g.add_argument("--max-connections-per-tenant", type=int, default=_server_default("max_connections_per_tenant"),
                   help="WebSocket connections and HTTP requests in progress per tenant, when the server has more "
                        "than one identity (default %(default)s)")
    g.add_argument("--auth-timeout-s", type=float, default=_server_default("auth_timeout_s"),
                   help="a WebSocket client that has not authenticated by then is disconnected (default %(default)g)")
    g.add_argument("--read-timeout-s", type=float, default=_server_default("read_timeout_s"),
                   help="time to send an HTTP request's headers, and between two pieces of its body "
                        "(default %(default)g)")
    g.add_argument("--write-timeout-s", type=float, default=_server_default("write_timeout_s"),
                   help="an SSE client that takes longer to take one event is dropped and its request ended "
                        "(default %(default)g)")
    g.add_argument("--max-store-mb", type=float, default=mib("max_store_bytes_per_tenant"),
                   help="programs stored per tenant; an upload past it evicts the tenant's least recently "
                        "launched programs (default %(default)g MiB)")
    g.add_argument("--program-ttl-h", type=float, default=_server_default("program_ttl_s") / 3600,
                   help="a program its tenant has not launched or uploaded for this long is evicted "
                        "(default %(default)g hours)")
    g.add_argument("--responses-max-stored", type=int, default=_server_default("responses_max_stored"),
                   help="/v1/responses kept in memory for previous_response_id; past it the oldest go "
                        "(default %(default)s)")
    g.add_argument("--responses-ttl-s", type=float, default=_server_default("responses_ttl_s"),
                   help="how long a stored response can be continued with previous_response_id (default %(default)g)")
    g.add_argument("--max-instances-per-tenant", type=int, default=None,
                   help="instances one tenant may run at once, WebSocket and HTTP together; 0 = no cap "
                        "(default: half of --max-instances when the server has more than one identity, else none)")


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
                        max_program_bytes=args.max_program_mb * MIB,
                        max_queued_bytes=int(args.max_queued_mb * MIB),
                        max_upload_bytes_in_flight=int(args.max_uploads_mb * MIB),
                        max_body_bytes=int(args.max_body_mb * MIB),
                        max_connections=args.max_connections,
                        max_connections_per_tenant=args.max_connections_per_tenant,
                        auth_timeout_s=args.auth_timeout_s, read_timeout_s=args.read_timeout_s,
                        write_timeout_s=args.write_timeout_s,
                        max_store_bytes_per_tenant=int(args.max_store_mb * MIB),
                        program_ttl_s=args.program_ttl_h * 3600,
                        responses_max_stored=args.responses_max_stored, responses_ttl_s=args.responses_ttl_s,
                        max_image_bytes=int(args.max_image_mb * MIB), max_images=args.max_images,
                        allow_remote_images=_remote_images(args.allow_remote_images),
                        matryoshka=None if args.matryoshka is None else tuple(args.matryoshka),
                        max_instances_per_tenant=_instances_per_tenant(args))


def _remote_images(patterns: list[str] | None) -> tuple[str, ...]:
    """--allow-remote-images: absent, none; alone, any global address ("*"); else its patterns (checked now)."""
    if patterns is None:
        return ()
    from host.net.policy import HttpPolicy

    out = tuple(patterns) or ("*",)
    HttpPolicy(out)  # a bad pattern is a usage error (ValueError)
    return out


def _instances_per_tenant(args: argparse.Namespace) -> int | None:
    """--max-instances-per-tenant, or its default: half the host's instances when tenants share it."""
    if args.max_instances_per_tenant is not None:
        return args.max_instances_per_tenant or None
    identities = (1 if args.auth_token else 0) + len(args.tenant)
    if identities <= 1:
        return None
    host_max: int = args.max_instances or HostConfig().max_instances
    return max(1, host_max // 2)


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
    if args.warm_start_instances is not None and args.warm_start_instances < 0:
        print(f"pie-serve: --warm-start-instances must be >= 0, got {args.warm_start_instances}", file=sys.stderr)
        return EXIT_USAGE
    handler_wasm = None
    if args.openai_handler != "none":
        try:  # before the model loads: a bad handler fails at once
            handler_wasm = resolve_inferlet(args.openai_handler, quiet=True).read_bytes()
        except (BuildError, OSError) as exc:
            print(f"pie-serve: --openai-handler: {exc}", file=sys.stderr)
            return EXIT_USAGE
    embedding_wasm = None
    if args.openai_handler != "none" and args.embedding_handler != "none":
        try:
            embedding_wasm = resolve_inferlet(args.embedding_handler, quiet=True).read_bytes()
        except (BuildError, OSError) as exc:
            print(f"pie-serve: --embedding-handler: {exc}", file=sys.stderr)
            return EXIT_USAGE
    from gpu_backend.engine.client import EngineDied

    try:
        host = Host(config)
    except (FileNotFoundError, ValueError, EngineDied) as exc:
        print(f"pie-serve: cannot load the model: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        warm_wasms = [resolve_inferlet(name, quiet=True).read_bytes() for name in args.warm_start
                      if args.warm_start != ["none"]]
    except (BuildError, OSError) as exc:
        host.shutdown()
        print(f"pie-serve: --warm-start: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        program = host.compile(handler_wasm) if handler_wasm is not None else None
        embedding = host.compile(embedding_wasm) if embedding_wasm is not None else None
        server = Server(host, server_config, openai_program=program, model_name=args.served_model_name,
                        embedding_program=embedding)
        if warm_wasms:  # (with the OpenAI handlers': each OpenAI request starts one)
            warm_wasms += [w for w in (handler_wasm, embedding_wasm) if w is not None]
            log.info("starting instances of %d inferlet(s) ahead of demand", len(warm_wasms))
            host.warm_start(warm_wasms, args.warm_start_instances)
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
