"""`pie-replay FILE [PROGRAM]`: re-run a guest against a recording (`pie-run --record FILE`) with no
model and no scheduler, and report the first call where it does something else.

Exit status: 0 the guest made the recorded calls, in order, and ended as recorded; 1 it diverged
(the position, the recorded call and the guest's are printed); 2 the input is unusable (not a
recording, cut short, another format version, no program to run). Imports no torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from wasmtime.component import Record, ResourceHost, Variant

from host.replay.format import Call, Recording, RecordingError, load
from host.replay.replay import Outcome, replay

__all__ = ["main", "show", "EXIT_IDENTICAL", "EXIT_DIVERGED", "EXIT_BAD_INPUT"]

EXIT_IDENTICAL, EXIT_DIVERGED, EXIT_BAD_INPUT = 0, 1, 2
_LIST_SHOWN = 8  # elements of a list shown before "... (N more)"
_STR_SHOWN = 120  # characters of a string


class _BadInput(Exception):
    """Unusable input: the message says what and what to do."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pie-replay",
        description="Re-run an inferlet against a recording of its host calls (pie-run --record FILE), "
                    "with no model, and report the first call where it diverges.")
    p.add_argument("recording", help="the recording file")
    p.add_argument("program", nargs="?", default=None,
                   help="the inferlet to replay: a .wasm file, a source folder or a standard inferlet's name "
                        "(default: the recorded program, found in the host's compiled cache by its hash, or "
                        "the standard inferlet the recording names, as built now)")
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="the host's cache directory, where compiled programs are kept (default: $PIE_CACHE_DIR "
                        "or ~/.cache/pie-python)")
    p.add_argument("--timeout-s", type=float, default=60.0, help="stop a guest that runs longer (default 60)")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the guest's stdout and stderr")
    return p


def main(argv: list[str] | None = None) -> int:
    opts = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        recording = _read(Path(opts.recording))
        from host.config import default_cache_dir
        from host.wasm.engine import WasmEngine

        engine = WasmEngine(opts.cache_dir or default_cache_dir())
        try:
            program, notes = _program(recording, opts.program, engine)
            outcome = replay(recording, engine.get(program), engine.engine, opts.timeout_s, engine.tick_s)
        finally:
            engine.close()
    except _BadInput as e:
        print(f"pie-replay: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for note in notes + outcome.notes:
        print(f"note: {note}")
    if opts.verbose and outcome.output:
        print(f"--- the guest's output ---\n{outcome.output.rstrip()}\n---", file=sys.stderr)
    return _report(recording, outcome)


def _read(path: Path) -> Recording:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _BadInput(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return load(data)
    except RecordingError as e:
        raise _BadInput(f"{path}: {e}") from None


def _program(recording: Recording, given: str | None, engine: Any) -> tuple[str, list[str]]:
    """The compiled program to replay, and notes on where it came from."""
    from host.cli.build import BuildError, resolve_inferlet, standard_inferlets
    from host.wasm.engine import CompileError

    if given is None and engine.has(recording.program):
        return recording.program, []
    name = given
    if name is None:
        if recording.program_name not in standard_inferlets():
            raise _BadInput(f"the recorded program {recording.program[:16]}... is not in the compiled cache "
                            f"({engine.cache_dir}) and the recording names no standard inferlet: pass "
                            "PROGRAM.wasm (the .wasm that was recorded)")
        name = recording.program_name
    try:
        path = resolve_inferlet(name, quiet=True)
        program = engine.compile(path.read_bytes())
    except (BuildError, FileNotFoundError, ValueError, OSError) as e:
        raise _BadInput(str(e)) from None
    except CompileError as e:
        raise _BadInput(f"{name} is not a valid inferlet component: {e}") from None
    notes = []
    if program != recording.program:
        notes.append(f"replaying {name} (sha256 {program[:12]}...), not the recorded program "
                     f"(sha256 {recording.program[:12]}...)")
    return program, notes


def _report(recording: Recording, outcome: Outcome) -> int:
    d = outcome.divergence
    if d is None:
        if outcome.truncated:
            print(f"replayed {outcome.replayed} calls: identical up to the end of the truncated recording "
                  "(what came after was not recorded)")
        else:
            print(f"replayed {outcome.replayed} calls: identical")
            print(f"end: {outcome.end[0]}: {show(outcome.end[1])}")
        return EXIT_IDENTICAL
    if d.recorded is None and d.guest is None:  # every call the same; the ends differ
        print(f"diverged at the end, after all {d.position} recorded calls (identical): {d.reason}")
        return EXIT_DIVERGED
    print(f"diverged at call {d.position + 1} of {len(recording.calls)} (position {d.position}; "
          f"the {d.position} before it identical): {d.reason}")
    print(f"  recorded: {_call(d.recorded) if d.recorded is not None else '(nothing: the recording ends here)'}")
    if d.guest is not None:
        print(f"  guest:    {d.guest[0]}({', '.join(show(a) for a in d.guest[1])})")
    elif d.recorded is not None:
        print(f"  guest:    (no call: it ended {outcome.end[0]}: {show(outcome.end[1])})")
    if recording.end is not None:
        print(f"  recorded end: {recording.end[0]}: {show(recording.end[1])}")
    return EXIT_DIVERGED


def _call(call: Call) -> str:
    outcome = f"-> {show(call.value)}" if call.ok else f"-> trap: {show(call.value)}"
    return f"{call.name}({', '.join(show(a) for a in call.args)}) {outcome}"


def show(value: Any, depth: int = 0) -> str:
    """A value as a short line: long lists and strings abbreviated, records as {field: value}."""
    if depth > 4:
        return "..."
    if isinstance(value, str):
        return repr(value) if len(value) <= _STR_SHOWN else \
            f"{value[:_STR_SHOWN]!r}... ({len(value) - _STR_SHOWN} more characters)"
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    if isinstance(value, (list, tuple)):
        items = [show(v, depth + 1) for v in value[:_LIST_SHOWN]]
        if len(value) > _LIST_SHOWN:
            items.append(f"... ({len(value) - _LIST_SHOWN} more)")
        inner = ", ".join(items)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, Record):
        return "{" + ", ".join(f"{k}: {show(v, depth + 1)}" for k, v in vars(value).items()) + "}"
    if isinstance(value, Variant):
        return f"{value.tag}({show(value.payload, depth + 1)})" if value.payload is not None else value.tag
    if isinstance(value, ResourceHost):
        return f"<resource {value.rep} of type {value.type:#x}>"
    rep = getattr(value, "remote_rep", None)
    if rep is not None:  # a guest's handle (wire.RemoteHandle)
        return f"<handle {rep}>"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(map(str, value))) + "}"
    return repr(value)


if __name__ == "__main__":
    sys.exit(main())
