"""constrained_json: sampled output that always parses as a JSON object.

Each step asks for the --top-k most probable next tokens (`next_dist`), masks out every token whose
text would make the output stop being a prefix of valid JSON (a pushdown checker, fed character by
character, runs inside the inferlet), renormalizes the rest and samples one (temperature, seeded).
When no candidate is valid or the token budget is spent, the shortest valid completion is appended
(close the string, finish the number, close every open bracket), so the result always parses.

Returns the JSON text; with --json {"text", "forced_suffix", "tokens"}.
"""

from __future__ import annotations

import json
import math
import random
import re

from inferlet import ArgumentParser, Context, InferletError, get_model


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="constrained_json", description="Generate a JSON object; the output always parses.")  # fmt: skip
    p.add_argument(
        "-p", "--prompt", default="Describe a person as a JSON object with the keys name, age and city."
    )
    p.add_argument(
        "-n", "--max-tokens", type=int, default=48, help="token budget before the forced close (48)"
    )
    p.add_argument("-t", "--temperature", type=float, default=0.7, help="0 = greedy among valid tokens (0.7)")
    p.add_argument("-k", "--top-k", type=int, default=40, help="candidates checked per step (40)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (0)")
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
    p = PARSER
    opts = p.parse(args)
    if opts.max_tokens < 1 or opts.top_k < 1 or opts.temperature < 0:
        raise InferletError("--max-tokens and --top-k must be >= 1, --temperature >= 0")
    model = get_model()
    rng = random.Random(opts.seed)
    pieces: dict[int, str] = {}
    state, text, tokens = START, "", []
    with Context(model) as ctx:
        ctx.fill_user(opts.prompt)
        ctx.flush()
        for _ in range(opts.max_tokens):
            if state[0] == "E":
                break
            ids, probs = ctx.next_dist(opts.top_k)
            valid: list[tuple[int, float, State]] = []
            for t, pr in zip(ids, probs, strict=False):
                piece = pieces.get(t)
                if piece is None:
                    piece = pieces[t] = model.decode([t])
                if piece and pr > 0 and (ns := feed(state, piece)) is not None:
                    valid.append((t, pr, ns))
            if not valid:
                break
            if opts.temperature == 0:
                t, _pr, ns = valid[0]
            else:
                weights = [math.exp(math.log(pr) / opts.temperature) for _t, pr, _ns in valid]
                t, _pr, ns = rng.choices(valid, weights=weights)[0]
            ctx.fill_tokens([t])
            tokens.append(t)
            text += pieces[t]
            state = ns
    suffix = closing(state)
    text += suffix
    if opts.json:
        return json.dumps({"text": text, "forced_suffix": suffix, "tokens": len(tokens)})
    return text
