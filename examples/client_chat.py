"""Ask a running `pie-serve` several questions at once, streaming each answer.

    pie-serve --port 8080 &
    python examples/client_chat.py --url ws://127.0.0.1:8080 "What is the capital of France?" "Name a colour."

Uploads the standard `text_completion` inferlet if the server lacks it, launches one instance per
question on one connection, and prints the streamed pieces as they arrive, tagged by question.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from host.cli.build import resolve_inferlet
from host.client import PieClient


async def ask(client: PieClient, program: str, n: int, question: str, max_tokens: int) -> str:
    iid = await client.launch(program, ["--prompt", question, "--max-tokens", str(max_tokens), "--stream"])
    async for event in client.events(iid):
        if event.event == "message":
            print(f"[{n}] {event.message!r}", flush=True)
        elif event.event == "completed":
            return event.message
        else:
            raise RuntimeError(f"question {n} ended with {event.event}: {event.message}")
    raise RuntimeError("unreachable: events end with a terminal event")


async def main(opts: argparse.Namespace) -> None:
    wasm = resolve_inferlet("text_completion").read_bytes()
    async with await PieClient.connect(opts.url, token=opts.token) as client:
        print("models:", await client.query("models"))
        program = await client.ensure_program(wasm)
        answers = await asyncio.gather(*(ask(client, program, n, q, opts.max_tokens)
                                         for n, q in enumerate(opts.questions)))
    for question, answer in zip(opts.questions, answers, strict=True):
        print(f"\nQ: {question}\nA: {answer}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("questions", nargs="+")
    ap.add_argument("--url", default="ws://127.0.0.1:8080")
    ap.add_argument("--token", default=os.environ.get("PIE_AUTH_TOKEN"))
    ap.add_argument("--max-tokens", type=int, default=64)
    asyncio.run(main(ap.parse_args()))
