"""Argument parsing for inferlets: argparse that reports errors instead of exiting the guest."""

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
        try:
            return self.parse_args(args)
        except argparse.ArgumentError as e:
            raise InferletError(f"{e}\n{self.format_usage().rstrip()}") from None


class _Help(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        raise HelpRequested(parser.format_help())
