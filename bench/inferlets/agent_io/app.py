"""Bench guest for bench/agent_io.py: a scripted agent whose loop is fixed, so that the inferlet way
and the client-driven way (the bench's OpenAI client) do the same LLM work and the same I/O.

Args: --kind react|codeact|swarm --ios N --tokens T [--case ID] [--tool-url URL] [--role agent|peer].

The agent's one `Context` holds the whole run (its KV is kept: only what is new is prefilled):
system prompt and task, then N times: generate T tokens greedily, do the I/O, append its result
as the next user message; then a final answer of T tokens. The I/O of each step:
  react    GET `<tool-url>?q=<case>-<step>` on the bench's tool server (outbound HTTP, `inferlet.http`);
  codeact  run `snippet(step)` (Python) right here, in the instance's sandbox, its stdout the result;
  swarm    send the step's text to a peer agent (a child instance of this same program, launched
           with --role peer, that keeps its own context) and take its reply (T tokens) as the result.
The prompts, the snippet and the observation text are module constants that bench/agent_io.py
imports, so its client way sends exactly these.

Returns JSON {"kind", "ios_done", "completion_tokens", "peer_tokens", "final"}.
"""

from __future__ import annotations

import io
import json
import sys

from inferlet import ArgumentParser, Context, InferletError, Sampler, _host, http, launch, receive, send
from inferlet.warmup import warm_up

SYSTEM = {
    "react": "You are a research agent. Think in one short line, then the web tool is called for you "
             "and you see its result. Keep going until you can answer.",
    "codeact": "You are a coding agent. Write one short line of Python for the next step; it is run for "
               "you and you see its output. Keep going until you can answer.",
    "swarm": "You are the lead of a team of two agents. Write one short message to your teammate; you "
             "will see their reply. Keep going until you can answer.",
}
PEER_SYSTEM = "You are the teammate of a lead agent. Answer each of its messages in one short line."
TASK = {
    "react": "Find the population of the three largest cities of France and add them up.",
    "codeact": "Compute the sum of the squares of the first hundred primes.",
    "swarm": "Plan a two-day trip to Lyon with your teammate.",
}
FINAL = "Now give the final answer."
SNIPPET = "n = {step} + 3\nacc = sum(i * i for i in range(n * 50)) % 9973\nprint('step', {step}, 'acc', acc)"


def snippet(step: int) -> str:
    """The code the codeact agent runs at `step` (the client way runs the same text)."""
    return SNIPPET.format(step=step)


def run_snippet(code: str) -> str:
    """`exec` the code with its stdout captured; the captured text, stripped."""
    out, saved = io.StringIO(), sys.stdout
    sys.stdout = out
    try:
        exec(code, {"__name__": "__snippet__"})  # noqa: S102 - the bench's own fixed snippet
    finally:
        sys.stdout = saved
    return out.getvalue().strip()


def task(kind: str, case: str) -> str:
    """The task message: the kind's task for case `case` (every agent of a run has its own case, so
    that agents share the system prompt's KV, as real ones do, but not their transcripts)."""
    return f"Case {case}. {TASK[kind]}"


def tool_query(case: str, step: int) -> str:
    """The query string of step `step`'s tool call (`?q=...`)."""
    return f"q={case}-{step}"


def observation(kind: str, step: int, result: str, last: bool) -> str:
    """The user message that carries step `step`'s I/O result back into the chat (the last one asks
    for the final answer)."""
    label = {"react": "Tool result", "codeact": "Output", "swarm": "Teammate"}[kind]
    return f"{label} {step}: {result}" + (f"\n{FINAL}" if last else "")


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="agent_io", description="A scripted agent: N steps of T tokens, each followed by I/O.")
    p.add_argument("--kind", choices=sorted(SYSTEM), default="react")
    p.add_argument("--ios", type=int, default=2, help="I/O steps (2)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per generation (8)")
    p.add_argument("--case", default="0", help="this agent's case id, part of its task (0)")
    p.add_argument("--tool-url", default="", help="the tool server's URL (react)")
    p.add_argument("--role", choices=("agent", "peer"), default="agent")
    p.add_argument("--timeout-ms", type=int, default=600_000, help="wait for the peer's reply (600000)")
    return p


PARSER = parser()


def _peer(tokens: int) -> str:
    """The swarm's teammate: each message from the parent is a user turn, answered with T tokens."""
    greedy = Sampler.greedy()
    generated = turns = 0
    with Context() as ctx:
        ctx.fill_system(PEER_SYSTEM)
        while True:
            msg = receive()
            if msg is None or msg == "":  # the parent is done (or gone)
                break
            ctx.fill_user(msg)
            before = len(ctx.tokens)
            send(ctx.generate(greedy, max_tokens=tokens))
            generated += len(ctx.tokens) - before
            turns += 1
    return json.dumps({"role": "peer", "turns": turns, "completion_tokens": generated})


def main(args: list[str]) -> str:
    a = PARSER.parse(args)
    if a.role == "peer":
        return _peer(a.tokens)
    if a.kind == "react" and not a.tool_url:
        raise InferletError("--kind react needs --tool-url")
    greedy = Sampler.greedy()
    child = launch("", ["--kind", "swarm", "--role", "peer", "--tokens", str(a.tokens)]) if a.kind == "swarm" else None
    generated = ios = peer_tokens = 0
    try:
        with Context() as ctx:
            ctx.fill_system(SYSTEM[a.kind])
            ctx.fill_user(task(a.kind, a.case))
            for step in range(a.ios):
                before = len(ctx.tokens)
                text = ctx.generate(greedy, max_tokens=a.tokens)
                generated += len(ctx.tokens) - before
                if a.kind == "react":
                    r = http.fetch(f"{a.tool_url}?{tool_query(a.case, step)}", timeout_ms=a.timeout_ms)
                    result = r.text()
                elif a.kind == "codeact":
                    result = run_snippet(snippet(step))
                else:
                    assert child is not None
                    child.send(text)
                    reply = child.receive(a.timeout_ms)
                    if reply is None:
                        raise InferletError(f"the peer did not reply to step {step}")
                    result = reply
                ios += 1
                ctx.fill_user(observation(a.kind, step, result, step == a.ios - 1))
            before = len(ctx.tokens)
            final = ctx.generate(greedy, max_tokens=a.tokens)
            generated += len(ctx.tokens) - before
        if child is not None:
            child.send("")
            peer_tokens = json.loads(child.wait(a.timeout_ms))["completion_tokens"]
    finally:
        if child is not None:
            child.release()
    return json.dumps({"kind": a.kind, "ios_done": ios, "completion_tokens": generated, "peer_tokens": peer_tokens,
                       "final": final})


if _host.IN_GUEST:  # pie-build: the codeact path (no outbound I/O) specialized in the snapshot
    warm_up(main, ["--kind", "codeact", "--ios", "1", "--tokens", "4"])
