"""What converting a host call's values costs: host/api/fastcall.py's paths vs wasmtime-py's own.

Usage: python bench/conversions.py --json OUT [--reps 2000] [--quick]

Every host call converts its arguments from the guest's C values (`lift`) and its result back
(`lower`). For the values `text_completion` exchanges with the host on every start and end (its
arguments, a chat message list, the encoded prompt, the stop tokens, `forward.generate-fresh`'s
`generation` record, the pages it releases), each conversion runs `--reps` times both ways in the
same process, alternating in rounds: `fast` (fastcall's replacements: list<u32> and list<string>
written and read with C-level slices or in place, a record's entries written in place, a record of
scalars and strings read in one unpack) and `wasmtime_py` (wasmtime-py's element-by-element
conversions; the byte-vector and type-memo patches of fastcall apply to both). Reports the median
microseconds per conversion over 5 rounds and `ratio` = fast / wasmtime_py. The types are built as
the linker hands them over (tests/test_fastcall.py checks both paths give the same values).
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wasmtime import _ffi as ffi
from wasmtime.component import _types as T

from host.api import fastcall


def _list(element: Any) -> T.ListType:
    lt = T.ListType.__new__(T.ListType)
    lt.__dict__["element"] = element
    return lt


def _record_type(fields: list[tuple[str, Any]]) -> T.RecordType:
    rt = T.RecordType.__new__(T.RecordType)
    rt.__dict__["fields"] = fields
    return rt


def _enum(names: list[str]) -> T.EnumType:
    et = T.EnumType.__new__(T.EnumType)
    et.__dict__["names"] = names
    return et


def _record(values: dict[str, Any]) -> T.Record:
    rec = T.Record()
    rec.__dict__.update(values)
    return rec


GENERATION = _record_type([("tokens", _list(T.U32())), ("new-pages", _list(T.U32())), ("trim", T.U32()),
                           ("finish", _enum(["length", "stop-token"]))])
MESSAGE = _record_type([("role", T.String()), ("content", T.String())])

# (name, type, value, direction): what text_completion's start and end convert
CASES: list[tuple[str, Any, Callable[[], Any], str]] = [
    ("arguments (list<string>)", _list(T.String()),
     lambda: ["--prompt", "What is the capital of France?", "--max-tokens", "64"], "lower"),
    ("apply-chat-template messages (list<record>)", _list(MESSAGE),
     lambda: [_record({"role": "system", "content": "You are a helpful assistant."}),
              _record({"role": "user", "content": "What is the capital of France?"})], "lift"),
    ("encode result (list<u32>, 30)", _list(T.U32()), lambda: list(range(100, 130)), "lower"),
    ("stop-tokens result (list<u32>, 2)", _list(T.U32()), lambda: [2, 7], "lower"),
    ("generate-fresh result (generation record, 64 tokens)", GENERATION,
     lambda: _record({"tokens": list(range(1000, 1064)), "new-pages": [5, 6, 7, 8], "trim": 0,
                      "finish": "length"}), "lower"),
    ("generate-fresh stop strings (list<string>)", _list(T.String()), lambda: ["\n\nUser:", "</s>"], "lift"),
    ("decode / release argument (list<u32>, 64)", _list(T.U32()), lambda: list(range(1000, 1064)), "lift"),
]


def time_lower(ty: Any, value: Any, reps: int) -> float:
    """Microseconds per conversion of `value` into a C value (freed after each, untimed)."""
    val = ffi.wasmtime_component_val_t()
    ptr = ctypes.pointer(val)
    spent = 0.0
    for _ in range(reps):
        t = time.perf_counter()
        ty.convert_to_c(None, value, ptr)
        spent += time.perf_counter() - t
        ffi.wasmtime_component_val_delete(ctypes.byref(val))
    return 1e6 * spent / reps


def time_lift(ty: Any, value: Any, reps: int) -> float:
    """Microseconds per conversion of a C value (made untimed each time) into Python; it frees it."""
    val = ffi.wasmtime_component_val_t()
    ptr = ctypes.pointer(val)
    spent = 0.0
    for _ in range(reps):
        ty.convert_to_c(None, value, ptr)
        t = time.perf_counter()
        ty.convert_from_c(val)
        spent += time.perf_counter() - t
    return 1e6 * spent / reps


def measure(reps: int, rounds: int = 5) -> dict[str, Any]:
    fastcall._patch_types()
    out: dict[str, Any] = {}
    for name, ty, make, direction in CASES:
        value = make()
        fast, ref = [], []
        run = time_lower if direction == "lower" else time_lift
        for _ in range(rounds):
            fast.append(run(ty, value, reps))
            with fastcall.wasmtime_py_values():
                ref.append(run(ty, value, reps))
        f, r = statistics.median(fast), statistics.median(ref)
        out[name] = {"direction": direction, "fast_us": round(f, 2), "wasmtime_py_us": round(r, 2),
                     "ratio": round(f / r, 3)}
        print(f"{direction:5s} {name:55s} fast {f:6.2f} us  wasmtime-py {r:6.2f} us  ratio {f / r:.2f}", flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    lines = ["# bench/conversions.py (median us per conversion; ratio = fast / wasmtime-py)", "",
             "| value | direction | fast | wasmtime-py | ratio |", "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['direction']} | {r['fast_us']} | {r['wasmtime_py_us']} | {r['ratio']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, type=Path, help="where to write the results")
    ap.add_argument("--reps", type=int, default=2000, help="conversions per round and path")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): 20 reps, 2 rounds")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(reps=20)
        opts = ap.parse_args()
    if opts.reps < 1:
        ap.error("--reps must be >= 1")
    results = measure(opts.reps, rounds=2 if opts.quick else 5)
    opts.json.write_text(json.dumps({"reps": opts.reps, "conversions": results}, indent=2) + "\n")
    opts.json.with_suffix(".md").write_text(table(results))


if __name__ == "__main__":
    main()
