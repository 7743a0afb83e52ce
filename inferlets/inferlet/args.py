"""Argument parsing for inferlets: argparse that reports errors instead of exiting the guest.

`parse` first tries a short path that handles what inferlets use (`--opt VALUE`, `--opt=VALUE`,
flags, simple positionals) with argparse's own action tables and gives the same namespace; on
anything else (abbreviations, `--`, nargs, help, an error to report) it hands the arguments to
argparse. Why: argparse's general parser costs ~0.3 ms inside a guest (CPython in wasm), which
is most of what a warm `text_completion` instance does before its first forward.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from inferlet.entry import HelpRequested, InferletError

__all__ = ["ArgumentParser"]


class ArgumentParser(argparse.ArgumentParser):
    """argparse for `main(args)`: a bad argument raises InferletError with the usage line (the
    instance's end reason) instead of calling sys.exit, and `-h/--help` raises HelpRequested,
    which makes the help text the instance's return value (main needs no code for it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("add_help", False)
        kwargs.setdefault("exit_on_error", False)
        super().__init__(*args, **kwargs)
        self.add_argument("-h", "--help", action=_Help, nargs=0, help="return this help text")

    def error(self, message: str) -> NoReturn:
        raise InferletError(f"{message}\n{self.format_usage().rstrip()}")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise InferletError(message or f"argument parser exited with status {status}")

    def parse(self, args: Sequence[str]) -> argparse.Namespace:
        """`parse_args` with every argparse failure turned into InferletError."""
        fast = _parse_simple(self, list(args))
        if fast is not None:
            return fast
        try:
            return self.parse_args(args)
        except argparse.ArgumentError as e:
            raise InferletError(f"{e}\n{self.format_usage().rstrip()}") from None


class _Help(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise HelpRequested(parser.format_help())


_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction)


def _simple(action: argparse.Action) -> bool:
    """An action the short path handles: store one value, or store a constant."""
    return (type(action) is argparse._StoreAction and action.nargs is None) or type(action) in _FLAG_ACTIONS


def _parse_simple(parser: argparse.ArgumentParser, args: list[str]) -> argparse.Namespace | None:
    """What `parser.parse_args(args)` returns, or None when argparse must decide (see the module doc)."""
    if parser.prefix_chars != "-" or parser.fromfile_prefix_chars or parser._mutually_exclusive_groups:
        return None
    options = parser._option_string_actions
    positionals = [a for a in parser._actions if not a.option_strings]
    if not all(_simple(a) for a in positionals) or any(type(a) is not argparse._StoreAction for a in positionals):
        return None
    values: dict[str, Any] = {}
    seen: set[argparse.Action] = set()
    given: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("-") or arg == "-":
            given.append(arg)
            continue
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        action = options.get(name)
        if action is None or not _simple(action):
            return None  # unknown, abbreviated, combined short flags, a negative number, --, help ...
        if type(action) is argparse._StoreAction:
            if not eq:
                if i >= len(args) or args[i].startswith("-"):
                    return None
                inline = args[i]
                i += 1
            value = _convert(action, inline)
            if value is _BAD:
                return None
        elif eq:
            return None
        else:
            value = action.const
        values[action.dest] = value
        seen.add(action)
    if len(given) != len(positionals):
        return None
    for action, text in zip(positionals, given, strict=True):
        value = _convert(action, text)
        if value is _BAD:
            return None
        values[action.dest] = value
        seen.add(action)
    return _namespace(parser, values, seen)


_BAD = object()


def _convert(action: argparse.Action, text: str) -> Any:
    """The action's type applied to `text` and its choices checked; _BAD if argparse must report it."""
    convert = action.type or str
    if not callable(convert):
        return _BAD  # a registered type name: argparse looks it up
    try:
        value = convert(text)
    except Exception:  # noqa: BLE001 - argparse reports it, with its own message
        return _BAD
    if action.choices is not None and value not in action.choices:
        return _BAD
    return value


def _namespace(parser: argparse.ArgumentParser, values: dict[str, Any], seen: set[argparse.Action]) -> \
        argparse.Namespace | None:
    """argparse's namespace: the parsed values, then defaults for the rest (a str default converted)."""
    ns = argparse.Namespace()
    for action in parser._actions:
        if action in seen or action.dest == argparse.SUPPRESS:
            continue
        if action.required:
            return None  # missing: argparse reports it
        if action.default is argparse.SUPPRESS or hasattr(ns, action.dest):
            continue
        default = action.default
        if isinstance(default, str) and action.dest not in values:
            default = _convert(action, default)
            if default is _BAD:
                return None
        setattr(ns, action.dest, default)
    for dest, value in values.items():
        setattr(ns, dest, value)
    for dest, value in parser._defaults.items():
        if not hasattr(ns, dest):
            setattr(ns, dest, value)
    return ns
