"""Launch a detached instance, disconnect, and collect its result later from a new connection.

    pie-serve --port 8080 &
    python examples/client_detached.py --url ws://127.0.0.1:8080

Detached instances keep running when their connection closes; their events are buffered on the
server until a connection attaches. Uses the synchronous client.
"""

from __future__ import annotations

import argparse
import os

from host.cli.build import resolve_inferlet
from host.client import SyncPieClient


def main(opts: argparse.Namespace) -> None:
    wasm = resolve_inferlet("text_completion").read_bytes()
    with SyncPieClient(opts.url, token=opts.token) as client:
        program = client.ensure_program(wasm)
        iid = client.launch(program, ["--prompt", opts.prompt, "--max-tokens", "64"], detached=True)
        print(f"launched {iid} detached; disconnecting")
    with SyncPieClient(opts.url, token=opts.token) as client:
        running = [i["id"] for i in client.query("instances")]
        print(f"still running after the disconnect: {iid in running}")
        client.attach(iid)
        for event in client.events(iid):
            print(f"{event.event}: {event.message}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="ws://127.0.0.1:8080")
    ap.add_argument("--token", default=os.environ.get("PIE_AUTH_TOKEN"))
    ap.add_argument("--prompt", default="Write a haiku about the sea.")
    main(ap.parse_args())
