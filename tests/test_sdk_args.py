"""The SDK's ArgumentParser short path gives exactly what argparse gives (argparse is the reference)."""

from __future__ import annotations

import argparse
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from inferlet import ArgumentParser, InferletError
from inferlet.args import _parse_simple


def tc_parser() -> ArgumentParser:
    """text_completion's options, a positional and a choices option."""
    p = ArgumentParser(prog="t")
    p.add_argument("-p", "--prompt", default="hi")
    p.add_argument("--system", default=None)
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("-t", "--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--raw", action="store_true")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--mode", choices=["a", "b"], default="a")
    p.add_argument("--level", type=int, default="3")  # a str default is converted by type
    return p


def reference(p: argparse.ArgumentParser, args: list[str]) -> str:
    try:
        return same(argparse.ArgumentParser.parse_args(p, args))
    except (argparse.ArgumentError, InferletError) as e:
        return f"error: {e}"


def same(ns: argparse.Namespace | None) -> str:
    """A namespace as comparable text (NaN equals NaN here, as both parsers return the same value)."""
    return repr(sorted(vars(ns).items())) if ns is not None else "declined"


TOKENS = ["-p", "--prompt", "--prompt=x y", "-n", "--max-tokens", "--max-tokens=7", "5", "-3", "abc", "",
          "--raw", "--raw=1", "--no-stream", "--mode", "a", "c", "--mode=b", "--level", "--temp", "--",
          "-t", "0.5", "nan", "--seed", "12", "-h", "-pz", "--unknown", "-", "--system", "sys", "--max"]


@settings(max_examples=int(os.environ.get("PIE_FUZZ_EXAMPLES", "300")), deadline=None)
@given(st.lists(st.sampled_from(TOKENS), max_size=8))
def test_short_path_equals_argparse_or_declines(args: list[str]) -> None:
    p = tc_parser()
    fast = _parse_simple(p, list(args))
    if fast is not None:  # when it answers, it answers what argparse answers
        assert same(fast) == reference(p, args)


@pytest.mark.parametrize("args", [
    [], ["--prompt", "x", "-n", "5"], ["--prompt=a=b", "--raw", "--no-stream"], ["-t", "1.5", "--seed", "9"],
    ["--mode", "b", "--level", "4", "--system", ""], ["-p", "", "-p", "last wins"],
])
def test_usual_arguments_take_the_short_path(args: list[str]) -> None:
    p = tc_parser()
    fast = _parse_simple(p, args)
    assert fast is not None and same(fast) == reference(p, args)


def test_positionals_and_errors_still_come_from_argparse() -> None:
    p = ArgumentParser(prog="s")
    p.add_argument("n", type=int)
    p.add_argument("prompt")
    p.add_argument("--hold", action="store_true")
    assert same(_parse_simple(p, ["3", "x", "--hold"])) == reference(p, ["3", "x", "--hold"])
    assert p.parse(["3", "x", "--hold"]) == argparse.Namespace(help=None, n=3, prompt="x", hold=True)
    with pytest.raises(InferletError, match="invalid int value"):
        p.parse(["three", "x"])
    with pytest.raises(InferletError, match="required"):
        p.parse(["3"])
    with pytest.raises(InferletError, match="unrecognized arguments"):
        p.parse(["3", "x", "y"])
