"""The scheduler's own time per batch for N host-side generation loops (`forward.generate`).

Usage: python bench/host_loops.py --json OUT [--loops 64 256] [--tokens 256] [--rounds 5] [--quick]

After each batch the scheduler thread turns every loop's request into its next step, one loop
after the other, while the backend waits: that time is the gap between two backend calls. This
measures it on the scheduler alone (no instances, no guests): N loops of `--tokens` tokens on the
stand-in backend with no delay, page size 16, the prefix cache on. Two ways of noting the steps'
writes are compared in the same run, alternating rounds:
- `page_notes`: as the host does (a loop notes its writes a page at a time and when it ends,
  `Generation.note_writes`);
- `step_notes`: the baseline, each step's write noted when it is queued (`PageManager.note_write`
  per step, what the host did before; every step goes through `Generation.advance`, so this side
  also goes without the fast steps, `Generation.fast_step`, which would skip the note).
Reports the median gap of the batches holding all N loops, in ms, per way and their ratio.
Writes JSON to --json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from common import BatchLog

from gpu_backend.standin import StandInBackend
from gpu_backend.types import ForwardRequest, OutputSpec, SamplerParams
from host.batching.generation import Generation, StopRules
from host.batching.policy import AdaptivePolicy
from host.batching.scheduler import Scheduler
from host.state.pages import InstancePages, PageManager
from host.state.prefix_cache import PrefixCache

PS = 16
PROMPT = 20


class StepNotes(Generation):
    """The baseline: every step's write noted as it is queued (one `note_write` per token)."""

    FAST_STEPS = False  # every step through `advance` and so `_next_step` (else a fast step skips the note)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._noted = 1 << 62  # the page-at-a-time notes off

    def _next_step(self, token: int) -> bool:
        ended = super()._next_step(token)
        if not ended:
            req = self.request
            self._pm.note_write(self._table, req, PS, (len(req.pages) - 1) * PS + req.last_page_len - 1)
        return ended


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--loops", type=int, nargs="+", default=[64, 256], help="loops running at once")
    ap.add_argument("--tokens", type=int, default=256, help="tokens each loop generates")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per way (alternating; medians reported)")
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): 4 and 16 loops, 32 tokens, 1 round")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(loops=[4, 16], tokens=32, rounds=1)
        opts = ap.parse_args()
    return opts


def one_round(make: type[Generation], n: int, tokens: int) -> float:
    """Median gap (ms) between the backend calls that held all n loops."""
    pages_per_loop = -(-(PROMPT + tokens) // PS) + 1
    backend = StandInBackend(page_size=PS, num_pages=n * pages_per_loop + 8)
    log = BatchLog(backend)
    pm = PageManager(backend.info.num_pages, cache=PrefixCache(PS, "per-client"))
    sched = Scheduler(AdaptivePolicy())
    sched.bind(backend.forward, None, PS, pins=pm)
    vocab = backend.info.vocab_size
    try:
        futs = []
        for k in range(n):
            table = InstancePages(f"loop{k}")
            pages = pm.allocate(table, 2)
            assert isinstance(pages, list)
            prompt = [(k * 7 + i) % vocab for i in range(PROMPT)]
            first = ForwardRequest(pages=list(pages), last_page_len=PROMPT - PS, tokens=prompt,
                                   positions=list(range(PROMPT)),
                                   outputs=[OutputSpec(index=PROMPT - 1, sample=SamplerParams())])
            pm.note_write(table, first, PS)
            gen = make(first, SamplerParams(), StopRules(tokens, frozenset(), (), 1 << 30), PS, pm, table,
                       lambda ids: "", None)
            futs.append(sched.submit(first, table.owner, generation=gen))
        for f in futs:
            res = f.wait()
            if len(res.tokens) != tokens:
                raise RuntimeError(f"a loop ended after {len(res.tokens)} tokens ({res.finish})")
    finally:
        sched.stop()
    full = [i for i, c in enumerate(log.calls) if c[2] == n]
    gaps = [1000 * (log.calls[i + 1][0] - log.calls[i][1]) for i in full if i + 1 < len(log.calls)]
    return statistics.median(gaps)


def main() -> None:
    opts = parse_args()
    results: dict[str, dict[str, float]] = {}
    for n in opts.loops:
        ways: dict[str, list[float]] = {"page_notes": [], "step_notes": []}
        for _ in range(opts.rounds):
            ways["page_notes"].append(one_round(Generation, n, opts.tokens))
            ways["step_notes"].append(one_round(StepNotes, n, opts.tokens))
        page, step = statistics.median(ways["page_notes"]), statistics.median(ways["step_notes"])
        results[str(n)] = {"page_notes_ms": round(page, 3), "step_notes_ms": round(step, 3),
                           "ratio": round(page / step, 3)}
        print(n, json.dumps(results[str(n)]), flush=True)
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps({"loops": results, "tokens": opts.tokens, "rounds": opts.rounds}, indent=2))


if __name__ == "__main__":
    main()
