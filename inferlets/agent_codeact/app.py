"""agent_codeact: the model writes Python, the inferlet runs it in its own Wasm sandbox.

The guest carries CPython, so generated code is `exec`uted right here, inside the instance's
sandbox: stdout is captured (capped at --max-output characters) and a `sys.settrace` budget stops
code that runs past --time-limit-ms (there are no threads or signals in the guest). The output
is filled back into the same context (KV kept) and the model continues: another code block is run
again, anything else is the final answer. A ```python block given in the task is run first, as the
agent's first action.

Returns the final answer; with --json {"answer", "transcript", "steps": [{"code", "output"}]}.
"""

from __future__ import annotations

import io
import json
import re
import sys
import time
import traceback
from collections.abc import Sequence

from inferlet import ArgumentParser, Context, InferletError, Sampler, get_model, send
from inferlet.sampler import AnyOf, MaxTokens, UntilTokens

SYSTEM = (
    "You solve tasks by writing Python code. Write the code in one ```python block and stop. "
    "You will then see its output. When you know the answer, reply with the answer only."
)
DEFAULT_TASK = "What is the sum of the squares of the numbers from 1 to 10?\n```python\nprint(sum(i * i for i in range(1, 11)))\n```"
_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="agent_codeact", description="A CodeAct agent: generated Python runs inside the inferlet's sandbox.")  # fmt: skip
    p.add_argument("--task", default=DEFAULT_TASK, help="the task (a ```python block in it is run first)")
    p.add_argument("--max-turns", type=int, default=2, help="most code executions (2)")
    p.add_argument("--code-tokens", type=int, default=96, help="most tokens per model turn (96)")
    p.add_argument("--time-limit-ms", type=int, default=1000, help="time limit per execution (1000)")
    p.add_argument("--max-output", type=int, default=2000, help="characters of output kept (2000)")
    p.add_argument("--json", action="store_true", help="return a JSON object with the transcript")
    return p


PARSER = parser()


class _TimeLimit(BaseException):
    """Raised inside executed code when it runs past its time limit (BaseException: `except Exception` can't eat it)."""


class _CappedOutput(io.StringIO):
    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap = cap

    def write(self, s: str) -> int:
        room = self.cap - self.tell()
        if room <= 0:
            return len(s)
        return super().write(s[:room])


def run_code(code: str, time_limit_ms: int, max_output: int) -> str:
    """Execute `code` in a fresh namespace; its stdout (and the error, if any) as text."""
    out = _CappedOutput(max_output)
    deadline = time.monotonic() + time_limit_ms / 1000

    def tracer(frame, event, arg):  # noqa: ANN001 - sys.settrace signature
        if time.monotonic() > deadline:
            raise _TimeLimit
        return tracer

    old_out, old_err = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    sys.settrace(tracer)
    try:
        exec(compile(code, "<agent>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})  # noqa: S102
    except _TimeLimit:
        out.write(f"TimeoutError: time limit of {time_limit_ms} ms exceeded\n")
    except BaseException as e:  # noqa: BLE001 - the code's error is its output
        out.write("".join(traceback.format_exception_only(e)))
    finally:
        sys.settrace(None)
        sys.stdout, sys.stderr = old_out, old_err
    return out.getvalue()


class _UntilBlock:
    """Stop once the generated text holds a complete ```python block."""

    def check(self, generated: Sequence[int], decode) -> int | None:  # noqa: ANN001
        return 0 if _BLOCK.search(decode(generated)) else None


def main(args: list[str]) -> str | None:
    p = PARSER
    opts = p.parse(args)
    if opts.max_turns < 0 or opts.code_tokens < 1 or opts.time_limit_ms < 1:
        raise InferletError("--max-turns must be >= 0, --code-tokens and --time-limit-ms >= 1")
    model = get_model()
    stop = AnyOf(MaxTokens(opts.code_tokens), UntilTokens(model.stop_tokens), _UntilBlock())
    steps: list[dict[str, str]] = []
    transcript = ""
    answer = ""
    with Context(model) as ctx:
        ctx.fill_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": opts.task}])
        given = _BLOCK.search(opts.task)
        for turn in range(opts.max_turns + 1):
            if turn == 0 and given is not None:
                code = given.group(1)
                reply = f"```python\n{code}```"
                ctx.fill(reply)  # the agent's first action: run the code given in the task
            else:
                reply = ctx.generate(Sampler.greedy(), stop=stop)
                block = _BLOCK.search(reply)
                if block is None or turn == opts.max_turns:
                    answer = reply.strip()
                    transcript += reply
                    break
                code = block.group(1)
            output = run_code(code, opts.time_limit_ms, opts.max_output)
            steps.append({"code": code, "output": output})
            send(json.dumps({"type": "execution", "code": code, "output": output}))
            feedback = f"\nOutput:\n```\n{output.rstrip()}\n```\n"
            ctx.fill(feedback)
            transcript += reply + feedback
    if opts.json:
        return json.dumps({"answer": answer, "transcript": transcript, "steps": steps})
    return answer
