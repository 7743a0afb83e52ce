"""constrained_json: sampled output constrained by a grammar over the whole vocabulary.

By default any JSON object; with --schema, JSON text that matches a JSON schema; with --regex, text that
fully matches a regular expression. The host masks every draw to the tokens the grammar allows
(`Context.generate(grammar=...)`, one host call for the whole generation) and the output ends when the
grammar's output is complete. Only when --max-tokens runs out first does the default mode close the
object itself (the shortest valid completion, from the character-level checker below), so the result
always parses; with --schema or --regex a truncated output is returned as it is (`complete`: false).

--schema takes the schema's JSON text; `pie-run constrained_json -- --schema FILE` reads FILE for it.
Returns the text; with --json {"text", "forced_suffix", "tokens", "complete"}.
"""

from __future__ import annotations

import json
import re

from inferlet import (
    ArgumentParser,
    Context,
    GrammarError,
    InferletError,
    Sampler,
    get_model,
    json_schema,
    regex,
)


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="constrained_json",
                       description="Generate a JSON object, JSON matching --schema, or text matching --regex.")
    p.add_argument(
        "-p", "--prompt", default="Describe a person as a JSON object with the keys name, age and city."
    )
    p.add_argument(
        "-n", "--max-tokens", type=int, default=48, help="token budget (48)"
    )
    p.add_argument("-t", "--temperature", type=float, default=0.7, help="0 = greedy among allowed tokens (0.7)")
    p.add_argument("-k", "--top-k", type=int, default=40, help="sample among the k most probable allowed tokens "
                                                               "(40; 0 = all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
    p.add_argument("--schema", default=None, metavar="FILE",
                   help="a JSON schema the output must match (its JSON text; pie-run reads a FILE)")
    p.add_argument("--regex", default=None, help="a regular expression the whole output must match")
    p.add_argument("--json", action="store_true", help="return a JSON object with details")
    return p


PARSER = parser()

# ---- JSON prefix checker ----------------------------------------------------------------------
# State: (mode, stack, buf). stack holds '{' / '[' of open containers. Modes:
#   O   start: only '{' (the output is an object)     V   a value is expected
#   V]  a value or ']' (just after '[')              K}  a key or '}' (just after '{')
#   K   a key (after ',' in an object)               :   the colon after a key
#   S / SK   inside a value / key string;  SE / SKE  right after a backslash in one
#   N   inside a number (buf = its text)             L   inside true/false/null (buf = text so far)
#   A   after a value: ',' or the closer              E   done: whitespace only
_NUM = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_LITERALS = ("true", "false", "null")
_WS = " \t\n\r"
_ESC = '"\\/bfnrt'

State = tuple[str, str, str]
START: State = ("O", "", "")


def _after_value(stack: str) -> State:
    return ("A", stack, "") if stack else ("E", "", "")


def _value_start(c: str, stack: str) -> State | None:
    if c == "{":
        return ("K}", stack + "{", "")
    if c == "[":
        return ("V]", stack + "[", "")
    if c == '"':
        return ("S", stack, "")
    if c == "-" or c.isdigit() and c.isascii():
        return ("N", stack, c)
    if c in "tfn":
        return ("L", stack, c)
    return None


def feed_char(st: State, c: str) -> State | None:
    mode, stack, buf = st
    if mode in ("S", "SK"):
        if c == '"':
            return (":", stack, "") if mode == "SK" else _after_value(stack)
        if c == "\\":
            return (mode + "E", stack, "")
        return None if ord(c) < 0x20 else st
    if mode in ("SE", "SKE"):
        return (mode[:-1], stack, "") if c in _ESC else None
    if mode == "N":
        if c in "0123456789+-.eE":
            nb = buf + c
            return ("N", stack, nb) if _NUM.fullmatch(nb) or _NUM.fullmatch(nb + "0") else None
        if not _NUM.fullmatch(buf):
            return None
        return feed_char(_after_value(stack), c)
    if mode == "L":
        nb = buf + c
        if any(lit.startswith(nb) for lit in _LITERALS):
            return _after_value(stack) if nb in _LITERALS else ("L", stack, nb)
        return None
    if c in _WS:
        return st
    if mode == "O":
        return ("K}", "{", "") if c == "{" else None
    if mode in ("V", "V]"):
        if mode == "V]" and c == "]":
            return _after_value(stack[:-1])
        return _value_start(c, stack)
    if mode in ("K", "K}"):
        if mode == "K}" and c == "}":
            return _after_value(stack[:-1])
        return ("SK", stack, "") if c == '"' else None
    if mode == ":":
        return ("V", stack, "") if c == ":" else None
    if mode == "A":
        top = stack[-1]
        if c == ",":
            return ("K", stack, "") if top == "{" else ("V", stack, "")
        if c == ("}" if top == "{" else "]"):
            return _after_value(stack[:-1])
        return None
    return None  # "E": only whitespace


def feed(st: State, text: str) -> State | None:
    for c in text:
        st = feed_char(st, c)  # type: ignore[assignment]
        if st is None:
            return None
    return st


def closing(st: State) -> str:
    """The shortest text that completes the JSON from this state."""
    out = []
    while st[0] != "E":
        mode, stack, buf = st
        if mode in ("SE", "SKE"):
            c = "n"
        elif mode in ("S", "SK"):
            c = '"'
        elif mode == "N":
            c = ("}" if stack[-1] == "{" else "]") if _NUM.fullmatch(buf) and stack else "0"
        elif mode == "L":
            lit = next(lit for lit in _LITERALS if lit.startswith(buf))
            c = lit[len(buf)]
        elif mode == "O":
            c = "{"
        elif mode == ":":
            c = ":"
        elif mode == "V":
            c = "0"
        elif mode == "V]":
            c = "]"
        elif mode in ("K}", "A"):
            c = "}" if stack[-1] == "{" else "]"
        else:  # "K": a key must follow the comma
            c = '"'
        out.append(c)
        st = feed_char(st, c)  # type: ignore[assignment]
        assert st is not None, f"closing: {c!r} rejected in {mode}"
    return "".join(out)


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    if opts.max_tokens < 1 or opts.top_k < 0 or opts.temperature < 0:
        raise InferletError("--max-tokens must be >= 1, --top-k and --temperature >= 0")
    if opts.schema is not None and opts.regex is not None:
        raise InferletError("give --schema or --regex, not both")
    prompt = opts.prompt
    if opts.schema is not None:
        try:
            json.loads(opts.schema)
        except ValueError as e:
            raise InferletError(f"--schema is not JSON text: {e}") from None
        grammar = json_schema(opts.schema)
        prompt += f"\nReply with JSON matching this JSON schema: {opts.schema}"
    else:
        grammar = json_schema() if opts.regex is None else regex(opts.regex)
    sampler = Sampler(temperature=opts.temperature, top_k=opts.top_k, seed=opts.seed)
    with Context(get_model()) as ctx:
        ctx.fill_user(prompt)
        try:
            matcher = grammar.matcher()
            text = ctx.generate(sampler, max_tokens=opts.max_tokens, grammar=matcher)
        except GrammarError as e:
            raise InferletError(str(e)) from None
        complete, tokens = matcher.is_terminated(), matcher.accepted
    suffix = ""
    if not complete and opts.schema is None and opts.regex is None:
        state = feed(START, text)
        assert state is not None, f"the JSON grammar produced invalid JSON: {text!r}"
        suffix = closing(state)
        text += suffix
    if opts.json:
        return json.dumps({"text": text, "forced_suffix": suffix, "tokens": tokens - complete, "complete": complete})
    return text
