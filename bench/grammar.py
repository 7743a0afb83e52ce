"""Structured generation cost: xgrammar vs llguidance token masks, and decode with a JSON-schema constraint.

    python bench/grammar.py --json bench/grammar.json [--quick]

xgrammar is only needed here, not a dependency: `pip install --no-deps xgrammar apache-tvm-ffi` (its
declared dependencies would pull another torch and triton).

One run measures, over the default model's vocabulary (49,152 tokens):
- per library, the compile time of each schema (caches off; median of `--repeats`) and the time to
  the first mask (llguidance builds its lexer lazily, so its compile cost shows up there);
- per library, the per-step matcher cost at 1 / 16 / 64 sequences: filling the packed int32 bitmask
  of every sequence with the library's batched call (same thread count for both), then accepting one
  token per sequence. The sequences replay valid documents of the typical schema, at staggered
  offsets so their states differ;
- on the real model with the chosen library (`gpu_backend.grammar`), decode time per step with and
  without the typical schema at 1 / 16 / 64 sequences, sampled at temperature 1 and greedy (fixed
  step count; a constrained sequence that finishes its document starts a new one so the batch keeps
  its size), with the part of each constrained step spent in the matchers (fill, pack, accept).
  The issue's target: <= 10% slower per step at 16 sequences. The two series alternate `--repeats`
  times and each keeps its best, so load from other processes hurts both alike. On CPU the sampler's
  full-vocabulary sort dominates a temperature-1 step, and a masked row (mostly zeros) sorts faster,
  so greedy is the series that isolates the mask's own cost;
- the sampler alone (greedy, synthetic logits) with and without a mask on every row: the cost of
  unpacking and applying the masks on the device;
- through the host: decode per step in the host's generation loop with and without a JSON-schema
  constraint at the same sizes (`host_loop`, bench/grammar_host.py: the masks filled and the matchers
  advanced on the scheduler thread, as forward.generate-constrained runs them).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:  # only for the library comparison (see the docstring); bench/grammar_host.py imports this file without it
    import xgrammar as xgr
except ImportError:
    xgr = None

from gpu_backend import ForwardRequest, OutputSpec, SamplerParams, load_backend
from gpu_backend.grammar import Grammar, GrammarCompiler, Matcher, mask_words, token_bytes
from gpu_backend.loading.tokenizer import Tokenizer
from gpu_backend.models.config import ModelInfo

SIZES = (1, 16, 64)
VOCAB = 49152  # the default model's; checked in main

# The typical schema: nested object, array with bounds, enum, integer with range, required + optional keys.
TYPICAL = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "score": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
# Documents of TYPICAL (keys in schema order, as xgrammar's default requires), replayed by the mask bench.
DOCS = [
    {"name": "Alice Smith", "age": 42, "role": "admin", "tags": ["ops", "dev"],
     "address": {"city": "Paris", "zip": "75001"}, "score": 0.5},
    {"name": "Bob", "age": 7, "role": "guest"},
    {"name": "Carla Jones", "age": 120, "role": "user", "tags": ["x"], "score": 1},
    {"name": "D. Okafor", "age": 33, "role": "user", "address": {"city": "Lagos"}},
    {"name": "Eve", "age": 0, "role": "admin", "tags": ["a", "bb", "ccc"], "score": 0.125},
    {"name": "Frank Li", "age": 65, "role": "guest", "address": {"city": "Shanghai", "zip": "20000"}},
]
SCHEMAS: dict[str, dict[str, Any]] = {
    "typical": TYPICAL,
    "enum_array": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
    "nested_numbers": {
        "type": "object",
        "properties": {
            "point": {"type": "object", "properties": {"x": {"type": "number", "minimum": -10, "maximum": 10},
                                                       "y": {"type": "number", "minimum": -10, "maximum": 10}},
                      "required": ["x", "y"], "additionalProperties": False},
            "count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["point"],
        "additionalProperties": False,
    },
}
QUESTION = ("Describe a fictional user as a JSON object with a name, an age, a role (admin, user or guest), "
            "a few tags, an address and a score between 0 and 1.")


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e3, 3)


# -- the two libraries, raw -------------------------------------------------------------------------


class XgrammarRun:
    """xgrammar over our vocabulary (specials as empty strings, its marker for special tokens), JSON
    written as `gpu_backend.grammar` writes it (no free whitespace, json.dumps separators)."""

    name = "xgrammar"

    def __init__(self, tok: Tokenizer, info: ModelInfo, threads: int) -> None:
        raw = [b"" if tok.is_special(i) else b for i, b in enumerate(token_bytes(tok, info.vocab_size))]
        self.info = xgr.TokenizerInfo(raw, xgr.VocabType.RAW, vocab_size=info.vocab_size,
                                      stop_token_ids=info.stop_tokens)
        self.threads = threads
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)

    def compile(self, schema: str) -> Any:
        comp = xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        return comp.compile_json_schema(schema, any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled: Any) -> Any:
        return xgr.GrammarMatcher(compiled)

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(mask))

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept_token(token))


class LlguidanceRun:
    """llguidance through our wrapper, `gpu_backend.grammar` (what the backend will use)."""

    name = "llguidance"

    def __init__(self, tok: Tokenizer, info: ModelInfo, threads: int) -> None:
        self.compiler = GrammarCompiler(tok, info, threads=threads)

    def compile(self, schema: str) -> Any:
        return self.compiler.json_schema(schema)

    def matcher(self, compiled: Any) -> Any:
        return Matcher(compiled)

    def fill(self, matchers: list[Any], mask: np.ndarray) -> None:
        self.compiler.fill_masks(matchers, mask)

    def accept(self, m: Any, token: int) -> bool:
        return bool(m.accept(token))


def compile_times(lib: XgrammarRun | LlguidanceRun, repeats: int) -> dict[str, dict[str, float]]:
    out = {}
    words = np.zeros((1, mask_words(VOCAB)), dtype=np.int32)
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        compiled = lib.compile(text)  # warm the code paths once
        lib.fill([lib.matcher(compiled)], words)
        ms = median_ms(lambda text=text: lib.compile(text), repeats)

        def first_mask(text: str = text) -> None:
            lib.fill([lib.matcher(lib.compile(text))], words)

        out[name] = {"compile_ms": ms, "compile_and_first_mask_ms": median_ms(first_mask, repeats)}
    return out


def mask_cost(lib: XgrammarRun | LlguidanceRun, docs: list[list[int]], n: int, steps: int) -> dict[str, float]:
    """Per-step ms for filling n masks (one batched call) and accepting n tokens, replaying `docs`."""
    compiled = lib.compile(json.dumps(TYPICAL))
    matchers = [lib.matcher(compiled) for _ in range(n)]
    # sequence i replays document i % len(docs), starting i // len(docs) tokens in (staggered states)
    pos = [0] * n
    for i, m in enumerate(matchers):
        doc = docs[i % len(docs)]
        for t in doc[: (i // len(docs)) % len(doc)]:
            lib.accept(m, t)
            pos[i] += 1
    mask = np.zeros((n, mask_words(VOCAB)), dtype=np.int32)
    fill_s = accept_s = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        lib.fill(matchers, mask)
        t1 = time.perf_counter()
        for i, m in enumerate(matchers):
            doc = docs[i % len(docs)]
            t = doc[pos[i]]
            if not (mask[i, t >> 5] >> (t & 31)) & 1 or not lib.accept(m, t):
                raise RuntimeError(f"{lib.name}: token {t} of document {i % len(docs)} refused")
            pos[i] += 1
            if pos[i] == len(doc):  # the stop token was accepted: start the document again
                m.reset()
                pos[i] = 0
        accept_s += time.perf_counter() - t1
        fill_s += t1 - t0
    return {"fill_ms": round(fill_s / steps * 1e3, 4), "accept_ms": round(accept_s / steps * 1e3, 4),
            "step_ms": round((fill_s + accept_s) / steps * 1e3, 4)}


# -- decode on the real model with gpu_backend.grammar ----------------------------------------------


def decode_ms_per_step(backend: Any, prompt: list[int], n: int, steps: int, compiler: GrammarCompiler,
                       grammar: Grammar | None, temperature: float, seed: int) -> tuple[float, float]:
    """(ms per decode step, of which ms in the matchers) for n sequences, prefill excluded; masked by
    `grammar` when given. The matcher time is filling the masks, packing them and accepting the tokens."""
    ps = backend.info.page_size
    need = math.ceil((len(prompt) + steps + 1) / ps)
    pages = [list(range(i * need, (i + 1) * need)) for i in range(n)]
    matchers = [Matcher(grammar) for _ in range(n)] if grammar is not None else []
    mask = np.zeros((n, mask_words(backend.info.vocab_size)), dtype=np.int32)
    lens, nxt = [len(prompt)] * n, [list(prompt) for _ in range(n)]
    t0 = matcher_s = 0.0
    for step in range(steps + 1):
        if step == 1:
            sync(backend.info.device)
            t0, matcher_s = time.perf_counter(), 0.0
        t1 = time.perf_counter()
        if matchers:
            compiler.fill_masks(matchers, mask)
        allowed = [mask[i].tobytes() if matchers else None for i in range(n)]
        matcher_s += time.perf_counter() - t1
        reqs = []
        for i in range(n):
            used, k = math.ceil(lens[i] / ps), len(nxt[i])
            sample = SamplerParams(temperature=temperature, seed=seed + step * n + i)
            reqs.append(ForwardRequest(
                pages=pages[i][:used], last_page_len=lens[i] - (used - 1) * ps, tokens=nxt[i],
                positions=list(range(lens[i] - k, lens[i])),
                outputs=[OutputSpec(index=k - 1, sample=sample, allowed=allowed[i])],
            ))
        res = backend.forward(reqs)
        t1 = time.perf_counter()
        for i, r in enumerate(res):
            tok = r[0].token
            assert tok is not None
            if matchers:
                if not matchers[i].accept(tok):
                    raise RuntimeError(f"sequence {i}: sampled token {tok} refused by its matcher")
                if matchers[i].is_terminated():  # keep the batch size: begin a new document
                    matchers[i].reset()
            nxt[i], lens[i] = [tok], lens[i] + 1
        matcher_s += time.perf_counter() - t1
    sync(backend.info.device)
    return (time.perf_counter() - t0) / steps * 1e3, matcher_s / steps * 1e3


def sampler_mask_ms(backend: Any, n: int, repeats: int = 20) -> dict[str, float]:
    """The sampler alone on n rows of the real vocabulary, greedy (no sort), without and with a mask
    on every row: the cost of unpacking and applying the masks on the backend's device."""
    sampler, vocab, dev = backend.sampler, backend.info.vocab_size, backend.model.device
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)).to(dev)
    packed = np.packbits(np.arange(vocab) % 7 == 0, bitorder="little").tobytes()  # 1 token in 7
    free = [OutputSpec(index=0, sample=SamplerParams())] * n
    masked = [OutputSpec(index=0, sample=SamplerParams(), allowed=packed)] * n
    out = {}
    for name, specs in (("unmasked_ms", free), ("masked_ms", masked)):
        sampler(logits, specs)
        out[name] = median_ms(lambda specs=specs: sampler(logits, specs), repeats)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--steps", type=int, default=200, help="mask bench steps per size")
    ap.add_argument("--decode-steps", type=int, default=24, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=3, help="compile repeats (median); decode repeats (best)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="mask threads, both libraries")
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    ap.add_argument("--device", default=None, help="decode device (default: cuda if available)")
    ap.add_argument("--no-decode", action="store_true", help="only the library comparison")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): sizes 1 and 2, 10 mask steps, 6 decode steps, 1 repeat")
    args = ap.parse_args()
    if args.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(steps=10, decode_steps=6, repeats=1, sizes=[1, 2])
        args = ap.parse_args()

    backend = load_backend(device=args.device, page_size=16, num_pages=2048, progress=False)
    tok, info = backend.tokenizer, backend.info
    if info.vocab_size != VOCAB:
        raise SystemExit(f"expected the default model's {VOCAB}-token vocabulary, got {info.vocab_size}")
    docs = [tok.encode(json.dumps(d)) + info.stop_tokens[:1] for d in DOCS]
    result: dict[str, Any] = {"libraries": {}, "meta": {
        "vocab": VOCAB, "threads": args.threads, "cpu_count": os.cpu_count(), "mask_steps": args.steps,
        "xgrammar": version("xgrammar") if xgr is not None else "not installed (comparison skipped)",
        "llguidance": version("llguidance"),
    }}
    libs: dict[str, XgrammarRun | LlguidanceRun] = {}
    for cls in (XgrammarRun, LlguidanceRun) if xgr is not None else (LlguidanceRun,):
        t0 = time.perf_counter()
        lib = libs[cls.name] = cls(tok, info, args.threads)
        entry: dict[str, Any] = {"tokenizer_info_ms": round((time.perf_counter() - t0) * 1e3, 1)}
        entry["compile"] = compile_times(lib, args.repeats)
        entry["mask"] = {str(n): mask_cost(lib, docs, n, args.steps) for n in args.sizes}
        result["libraries"][lib.name] = entry
        print(lib.name, json.dumps(entry))
    if not args.no_decode:
        ours = libs["llguidance"]
        assert isinstance(ours, LlguidanceRun)
        grammar = ours.compiler.json_schema(json.dumps(TYPICAL))
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
        decode: dict[str, dict[str, dict[str, float]]] = {}
        for label, temperature in (("temperature_1", 1.0), ("greedy", 0.0)):
            decode[label] = {}
            for n in args.sizes:
                free = constrained = (math.inf, 0.0)
                for r in range(args.repeats):
                    run = functools.partial(decode_ms_per_step, backend, prompt, n, args.decode_steps,
                                            ours.compiler, temperature=temperature, seed=r)
                    free = min(free, run(None))
                    constrained = min(constrained, run(grammar))
                row = decode[label][str(n)] = {
                    "unconstrained_ms": round(free[0], 2), "json_schema_ms": round(constrained[0], 2),
                    "matcher_ms": round(constrained[1], 3), "slowdown": round(constrained[0] / free[0] - 1, 4)}
                print("decode", label, n, row)
        result["sampler_mask"] = {str(n): sampler_mask_ms(backend, n) for n in args.sizes}
        print("sampler mask", result["sampler_mask"])
        result["decode"] = decode
        from grammar_host import host_loop  # this folder is on sys.path when run as a script

        result["host_loop"] = host_loop(backend, ours.compiler, args.sizes, args.decode_steps, args.repeats)
        result["meta"].update(device=info.device, dtype=info.dtype, decode_steps=args.decode_steps,
                              prompt_tokens=len(prompt), decode_library="llguidance")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
