"""Beam search vs greedy on the embedded host: `python examples/beam_search.py`."""

from __future__ import annotations

import json

from _common import make_host, run, show


def main() -> None:
    host = make_host()
    try:
        prompt = "Name a color."
        for width in (1, 4):
            out = json.loads(run(host, "beam_search", ["--prompt", prompt, "--beam-width", str(width),
                                                       "--max-tokens", "16", "--length-penalty", "0", "--json"]))
            show(f"beam width {width} (log-probability {out['logprob']:.3f})", out["text"])
    finally:
        host.shutdown()


if __name__ == "__main__":
    main()
