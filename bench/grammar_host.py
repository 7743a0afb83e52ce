"""Decode through the host's generation loop with and without a JSON-schema constraint.

    python bench/grammar_host.py --json bench/grammar.json [--quick]  # adds / replaces its "host_loop" section
    (bench/grammar.py runs it too, after the backend-level decode)

n sequences run as host-side loops on the scheduler (`forward.generate`'s machinery), all resident in
every batch: plain `Generation`s, or `ConstrainedGeneration`s whose masks are filled and whose matchers
advance on the scheduler thread after each step (`forward.generate-constrained`). Time per step = the
wall time between batches in which every sequence steps, prefill excluded; temperature 1, no stop token,
and a schema whose documents are longer than the run (a 30-item array of the typical object), so
every sequence runs every step. The two series alternate `--repeats` times and each keeps its best.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import BatchLog  # noqa: E402  (a sibling: this folder is on sys.path when run as a script)

from gpu_backend import ForwardRequest, OutputSpec, SamplerParams, load_backend  # noqa: E402
from gpu_backend.grammar import Grammar, GrammarCompiler, Matcher  # noqa: E402
from host import Host, HostConfig  # noqa: E402
from host.batching.constrained import ConstrainedGeneration, allowed_mask  # noqa: E402
from host.batching.generation import Generation, StopRules  # noqa: E402
from host.state.pages import InstancePages  # noqa: E402

SIZES = (1, 16, 64)
QUESTION = "List 30 users as a JSON array of objects with name, age, role, tags and email."


def long_schema() -> dict[str, Any]:
    from grammar import TYPICAL  # bench/grammar.py's typical schema (this folder is on sys.path)

    return {"type": "array", "items": TYPICAL, "minItems": 30, "maxItems": 30}


def loop_ms_per_step(host: Host, log: BatchLog, prompt: list[int], n: int, steps: int, grammar: Grammar | None,
                     seed: int) -> float:
    """ms per batch of n host-loop steps: the median start-to-start period of the backend calls that
    hold all n sequences, the first one (the prefill) excluded. (The calls are timed, not the loops'
    `advance`: a step whose token needs no rule but the length goes through `Generation.fast_step`.)"""
    pm, ps = host.pages, host.backend.info.page_size
    table = InstancePages(f"bench-{n}-{seed}")
    futures = []
    first_call = len(log.calls)
    try:
        for i in range(n):
            pages = pm.allocate(table, math.ceil(len(prompt) / ps))
            assert not isinstance(pages, str), pages
            sample = SamplerParams(temperature=1.0, seed=seed * 1000 + i)
            req = ForwardRequest(pages=pages, last_page_len=len(prompt) - (len(pages) - 1) * ps, tokens=list(prompt),
                                 positions=list(range(len(prompt))),
                                 outputs=[OutputSpec(index=len(prompt) - 1, sample=sample)], name=f"seq {i}")
            rules = StopRules(steps + 2, frozenset(), (), 2**31)
            args = (req, sample, rules, ps, pm, table, host.backend.tokenizer.decode, None)
            if grammar is None:
                gen: Generation = Generation(*args)
            else:
                m = Matcher(grammar)
                first = allowed_mask(m)
                assert isinstance(first, bytes), first
                gen = ConstrainedGeneration(*args, matcher=m, first_mask=first)
            futures.append(host.scheduler.submit(req, table.owner, generation=gen))
        for f in futures:
            res = f.wait()
            assert res.finish == "length", res.finish
    finally:
        pm.release_all(table)
    calls = sorted(log.calls[first_call:])
    full = [i for i, c in enumerate(calls) if c[2] == n][1:]  # steps of every sequence, prefill excluded
    gaps = [calls[j][0] - calls[i][0] for i, j in zip(full, full[1:], strict=False) if j == i + 1]
    if not gaps:
        raise RuntimeError(f"no two batches in a row held all {n} sequences ({len(calls)} backend calls)")
    return statistics.median(gaps) * 1e3


def host_loop(backend: Any, compiler: GrammarCompiler, sizes: list[int], steps: int, repeats: int) -> dict[str, Any]:
    """The "host_loop" section: per size, ms per step unconstrained / constrained and the slowdown."""
    grammar = compiler.json_schema(json.dumps(long_schema()))
    tok = backend.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    out: dict[str, Any] = {"steps": steps, "prompt_tokens": len(prompt), "temperature": 1.0}
    log = BatchLog(backend)  # (wraps the backend's calls for good: the bench's backend is used for nothing after)
    with Host(HostConfig(data_dir=Path(tempfile.mkdtemp())), backend=backend) as host:
        for n in sizes:
            free = constrained = math.inf
            for r in range(repeats):
                free = min(free, loop_ms_per_step(host, log, prompt, n, steps, None, r))
                constrained = min(constrained, loop_ms_per_step(host, log, prompt, n, steps, grammar, r))
            row = out[str(n)] = {"unconstrained_ms": round(free, 2), "json_schema_ms": round(constrained, 2),
                                 "slowdown": round(constrained / free - 1, 4)}
            print("host loop", n, row, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="merge the results into this file (its host_loop section)")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--device", default=None)
    ap.add_argument("--quick", action="store_true", help="a small, fast run (CI): sizes 1 and 2, 6 steps, 1 repeat")
    args = ap.parse_args()
    if args.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(steps=6, repeats=1, sizes=[1, 2])
        args = ap.parse_args()
    backend = load_backend(device=args.device, page_size=16, num_pages=4096, progress=False)
    section = host_loop(backend, GrammarCompiler(backend.tokenizer, backend.info), args.sizes, args.steps,
                        args.repeats)
    section.update(device=backend.info.device, dtype=backend.info.dtype)
    if args.json:
        data = json.loads(args.json.read_text()) if args.json.is_file() else {}
        data["host_loop"] = section
        args.json.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
