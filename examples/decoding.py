"""Decoding techniques on the embedded host: `python examples/decoding.py [NAME ...]`.

parallel_generation, constrained_json, speculative_decoding, windowed_attention, tree_of_thought.
"""

from __future__ import annotations

import sys

from _common import make_host, run, show

DEMOS = {
    "parallel_generation": ["--num", "4", "--max-tokens", "24", "--json"],
    "constrained_json": ["--seed", "3", "--json"],
    "speculative_decoding": ["--max-tokens", "48", "--json"],
    "windowed_attention": ["--max-tokens", "256", "--window", "48", "--ignore-stop"],
    "tree_of_thought": ["--depth", "2", "--branch", "3", "--keep", "2"],
}


def main(names: list[str]) -> None:
    unknown = set(names) - set(DEMOS)
    if unknown:
        raise SystemExit(f"unknown demo(s) {sorted(unknown)}; choose from {sorted(DEMOS)}")
    host = make_host()
    try:
        for name in names or DEMOS:
            show(name, run(host, name, DEMOS[name]))
    finally:
        host.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
