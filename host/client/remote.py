"""`run_remote`: what `pie-run --server URL` does: run one inferlet on a server, like pie-run locally."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Iterable
from pathlib import Path

from host.client.client import ConnectionLost, PieClient, PieError
from host.events import print_log

__all__ = ["run_remote", "EXIT_CODES", "EXIT_CLIENT_ERROR"]

log = logging.getLogger(__name__)

# Exit status of `run_remote` per terminal event, as the embedded `pie-run` uses them;
# a failure before the instance ends (connect, upload, launch, lost connection) exits 1.
EXIT_CODES = {"completed": 0, "exception": 1, "out_of_resources": 1, "aborted": 130}
EXIT_CLIENT_ERROR = 1


def run_remote(url: str, wasm_path: Path, args: list[str], *, token: str | None = None,
               stdin_lines: Iterable[str] | None = None, priority: int = 0, record: Path | None = None,
               program_name: str | None = None) -> int:
    """Run one inferlet on a server, like `pie-run` does locally; returns the exit status.

    Uploads the program if the server lacks it, launches it, prints its messages to stdout and its
    return value at the end. Lines from `stdin_lines` are sent as signals as they come; when they
    run out nothing more is sent. Exit status: see `EXIT_CODES`; reasons go to stderr.
    """
    try:
        data = Path(wasm_path).read_bytes()
    except OSError as exc:
        print(f"pie-run: cannot read {wasm_path}: {exc}", file=sys.stderr)
        return EXIT_CLIENT_ERROR
    return asyncio.run(_run_remote(url, data, args, token, stdin_lines, priority, record, program_name))


async def _run_remote(url: str, data: bytes, args: list[str], token: str | None,
                      stdin_lines: Iterable[str] | None, priority: int = 0, record: Path | None = None,
                      program_name: str | None = None) -> int:
    try:
        client = await PieClient.connect(url, token=token)
    except (OSError, TimeoutError, PieError) as exc:
        print(f"pie-run: cannot connect to {url}: {exc}", file=sys.stderr)
        return EXIT_CLIENT_ERROR
    forwarder: asyncio.Task[None] | None = None
    try:
        iid = await client.launch(await client.ensure_program(data), args, priority=priority, record=record is not None)
        if stdin_lines is not None:
            forwarder = asyncio.create_task(_forward_lines(client, iid, stdin_lines))
        async for event in client.events(iid):
            if event.event == "message":
                print(event.message, flush=True)
            elif event.event == "log":
                print_log(event)
            elif event.event == "completed":
                if event.message:
                    print(event.message, flush=True)
                await _save_recording(client, iid, record, program_name)
                return 0
            else:
                print(f"pie-run: inferlet {event.event}: {event.message}", file=sys.stderr)
                await _save_recording(client, iid, record, program_name)
                return EXIT_CODES.get(event.event, 1)
        raise ConnectionLost("event stream ended without a terminal event")
    except PieError as exc:
        print(f"pie-run: {exc}", file=sys.stderr)
        return EXIT_CLIENT_ERROR
    finally:
        if forwarder is not None:
            forwarder.cancel()
        await client.close()


async def _save_recording(client: PieClient, iid: str, record: Path | None, program_name: str | None) -> None:
    """`pie-run --server --record FILE`: fetch the ended instance's recording and write it."""
    if record is None:
        return
    from host.replay.format import save  # (light: no wasmtime)

    try:
        data = await client.recording(iid)
    except PieError as exc:
        print(f"pie-run: no recording: {exc}", file=sys.stderr)
        return
    print(save(record, data, program_name), file=sys.stderr)


async def _forward_lines(client: PieClient, instance_id: str, lines: Iterable[str]) -> None:
    """Send each line as a signal; reads `lines` on a daemon thread (stdin blocks)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[str | None] = asyncio.Queue()

    def pump() -> None:
        try:
            for line in lines:
                loop.call_soon_threadsafe(queue.put_nowait, line.rstrip("\r\n"))
            loop.call_soon_threadsafe(queue.put_nowait, None)
        except RuntimeError:  # the run already ended and its loop is closed: nobody to send to
            return

    threading.Thread(target=pump, name="pie-run-stdin", daemon=True).start()
    try:
        while (line := await queue.get()) is not None:
            await client.signal(instance_id, line)
        await client.close_input(instance_id)  # EOF: receive() returns none, like the embedded pie-run
    except PieError as exc:  # typically: the instance finished while input was still coming
        log.info("stopped forwarding input: %s", exc)
