"""What starting an instance costs the host, piece by piece, and what each allocator setting gives.

Usage: python bench/instance_start.py --json OUT [--instances 64] [--rounds 5]
                                      [--variants pool16 pool4 pool0 on_demand] [--no-runtime] [--quick]

For each variant, on a host of its own (the stand-in backend, no warm pool), `--rounds` rounds of
`--instances` standard `text_completion` instances, started one after another up to their first
host call (as the warm pool starts them), then all ended and their stores freed on the calling
thread. Per instance, medians over the rounds after the first (the first round uses every pool
slot for the first time; its numbers are reported apart as `first_use_*`):
- `start_cpu_ms`: the process's CPU from `Instance.start` to the guest's first host call (the store,
  wasmtime's instantiation of the component's core modules, the guest up to that call);
- `free_cpu_ms`: ending a parked instance and freeing its store (the pooling allocator's reset of
  the slot's memory);
- `start_faults` / `free_faults`: minor page faults in each;
- `parallel_cores`: N instances started at once, one thread each, the process's CPU over the wall
  time until all reached their first call (how far starts spread over the cores; 1.0 = serial).
Variants: `pool16` (the host's default: pooling allocator, the first 16 MiB of a slot's memory
reset by a copy and kept resident), `pool4` / `pool0` (4 MiB / nothing kept: the rest given back
to the kernel, faulted in again by the next instance), `on_demand` (no pool: memory mapped at each
instantiation, unmapped at the end).

Also: `components_mb`, the size of each standard inferlet's component; `runtime_mb`, the size of a
componentize-py component with no SDK and no inferlet (the interpreter and its standard library
alone: what a shared guest runtime would take out of each inferlet), and its memory image next to
text_completion's (`image_mb`: the initial linear memory every instance starts from and every free
resets); `rss_mb_per_primed_slot` (a pool slot used and reset once: what it keeps resident),
`rss_mb_per_parked` (a parked text_completion instance, beyond its primed slot) and
`rss_mb_per_live` (bench/host_scale.py's 256 live `step` instances, the warm pool off).
Writes JSON to --json and a markdown table next to it (.md).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import compile_inferlet
from host_scale import make_host, rss_mb, rss_per_instance

import host.host as host_module
from host.cli.build import resolve_inferlet, standard_inferlets
from host.host import _ignore
from host.wasm.instance import Instance
from host.wasm.pooling import PoolingConfig

VARIANTS: dict[str, dict[str, Any]] = {
    "pool16": {"keep_resident_bytes": 16 << 20},
    "pool4": {"keep_resident_bytes": 4 << 20},
    "pool0": {"keep_resident_bytes": 0},
    "on_demand": {"instance_pool": False},
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--instances", type=int, default=64, help="instances per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per variant (the first is reported apart)")
    ap.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--no-runtime", action="store_true", help="skip building the bare runtime component")
    ap.add_argument("--quick", action="store_true",
                    help="a small, fast run (CI): 4 instances, 2 rounds, no bare runtime build, only "
                         "text_completion's component size, 8 instances for the memory numbers")
    opts = ap.parse_args()
    if opts.quick:  # the defaults shrink; what is given on the command line stays
        ap.set_defaults(instances=4, rounds=2, no_runtime=True)
        opts = ap.parse_args()
    return opts


def _usage() -> tuple[float, int]:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime, ru.ru_minflt


def _wait_first_call(insts: list[Instance]) -> None:
    for inst in insts:
        with inst.cond:
            inst.cond.wait_for(lambda i=inst: i.at_first_call or i.finished.is_set(), 30)  # type: ignore[misc]
        if not inst.at_first_call:
            raise RuntimeError(f"a warm instance did not reach its first call: {inst.state}")


def one_round(host: Any, program: str, n: int) -> dict[str, float]:
    """n serial starts to the first call, then n ends and frees (on the ending threads)."""
    insts = []
    cpu0, flt0 = _usage()
    for _ in range(n):
        inst = Instance(host._env, program, [], _ignore, warm=True)
        inst.start()
        _wait_first_call([inst])
        insts.append(inst)
    cpu1, flt1 = _usage()
    for inst in insts:
        inst.terminate("measured")
        inst.join(30)
    cpu2, flt2 = _usage()
    # n at once, one thread each
    t0 = time.perf_counter()
    insts = [Instance(host._env, program, [], _ignore, warm=True) for _ in range(n)]
    for inst in insts:
        inst.start()
    _wait_first_call(insts)
    wall = time.perf_counter() - t0
    cpu3, _ = _usage()
    for inst in insts:
        inst.terminate("measured")
        inst.join(30)
    return {"start_cpu_ms": 1000 * (cpu1 - cpu0) / n, "free_cpu_ms": 1000 * (cpu2 - cpu1) / n,
            "start_faults": (flt1 - flt0) / n, "free_faults": (flt2 - flt1) / n,
            "parallel_cores": (cpu3 - cpu2) / wall}


def measure_variant(name: str, n: int, rounds: int) -> dict[str, float]:
    settings = dict(VARIANTS[name])
    config: dict[str, Any] = {"warm_auto": 0, "warm_instances": 0}
    original = host_module.PoolingConfig
    if "keep_resident_bytes" in settings:
        keep = settings["keep_resident_bytes"]

        class Kept(PoolingConfig):  # the host's sizes, this much kept resident
            def __init__(self, slots: int, limits: Any) -> None:
                super().__init__(slots, limits, keep_resident_bytes=keep)

        host_module.PoolingConfig = Kept  # type: ignore[misc]
    else:
        config.update(settings)
    try:
        host = make_host("inproc", 0.01, **config)
    finally:
        host_module.PoolingConfig = original  # type: ignore[misc]
    try:
        program = compile_inferlet(host, "text_completion")
        if host.wasm.reaper is not None:  # frees on the ending threads, where they are measured
            host.wasm.reaper.close()
            host.wasm.reaper = None
        runs = [one_round(host, program, n) for _ in range(rounds)]
    finally:
        host.shutdown()
    first, rest = runs[0], runs[1:] or runs
    out = {k: round(statistics.median(r[k] for r in rest), 3) for k in first}
    out.update({f"first_use_{k}": round(v, 3) for k, v in first.items() if k != "parallel_cores"})
    return out


def rss_per_parked(n: int = 256) -> tuple[float, float]:
    """Resident memory per primed slot (a slot used and reset once, as on a host that has served or
    been warm-started) and per parked text_completion instance in such a slot, in MB."""
    host = make_host("inproc", 0.01, warm_auto=0, warm_instances=0)
    try:
        program = compile_inferlet(host, "text_completion")
        time.sleep(0.5)
        before = rss_mb()
        host.warm.prime(program, n)
        time.sleep(0.5)
        primed = rss_mb()
        host.prewarm(program, n)
        parked = rss_mb()
        return round((primed - before) / n, 2), round((parked - primed) / n, 2)
    finally:
        host.shutdown()


def rss_per_live(n: int = 256) -> float:
    """Resident memory per live `step` instance (host_scale's measure), the warm pool off: its refills
    would be counted too (as bench/host_scale.py measures it: no step delay)."""
    host = make_host("inproc", 0.0, warm_auto=0, warm_instances=0)
    try:
        return rss_per_instance(host, compile_inferlet(host, Path(__file__).parent / "inferlets" / "stepper"), n)
    finally:
        host.shutdown()


def runtime_component(tmp: Path) -> Path | None:
    """A componentize-py component exporting one function, no SDK, no inferlet: the runtime alone."""
    exe = Path(sys.executable).parent / "componentize-py"
    if not exe.exists():
        return None
    (tmp / "wit").mkdir()
    (tmp / "wit" / "world.wit").write_text("package bench:bare;\nworld bare {\n  export run: func() -> string;\n}\n")
    (tmp / "app.py").write_text("import wit_world\n\n\nclass WitWorld(wit_world.WitWorld):\n"
                                "    def run(self) -> str:\n        return 'ok'\n")
    out = tmp / "bare.wasm"
    res = subprocess.run([str(exe), "-d", str(tmp / "wit"), "-w", "bare", "componentize", "-p", str(tmp), "app",
                          "-o", str(out)], capture_output=True, text=True)
    return out if res.returncode == 0 and out.exists() else None


def _leb(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return result, i


def _data_section_bytes(component: bytes) -> float | None:
    """The size of the first core module's data section (section id 11) inside a component, in MB."""
    i = 8  # magic + version/layer
    while i < len(component):
        sec, i = component[i], i + 1
        size, i = _leb(component, i)
        if sec == 1:  # a core module section: walk its sections
            mod, j = component[i:i + size], 8
            while j < len(mod):
                msec, j = mod[j], j + 1
                msize, j = _leb(mod, j)
                if msec == 11:
                    return round(msize / 1e6, 2)
                j += msize
            return None
        i += size
    return None


def main() -> None:
    opts = parse_args()
    results: dict[str, Any] = {"instances": opts.instances, "rounds": opts.rounds, "variants": {}}
    for name in opts.variants:
        results["variants"][name] = row = measure_variant(name, opts.instances, opts.rounds)
        print(f"{name}: {json.dumps(row)}", flush=True)
    names = ["text_completion"] if opts.quick else standard_inferlets()  # (each one not cached is built)
    results["components_mb"] = {name: round(resolve_inferlet(name, quiet=True).stat().st_size / 1e6, 2)
                                for name in names}
    tc = resolve_inferlet("text_completion", quiet=True)
    results["image_mb"] = {"text_completion": _data_section_bytes(tc.read_bytes())}
    if not opts.no_runtime:
        with tempfile.TemporaryDirectory(prefix="pie-bench-runtime-") as tmp:
            bare = runtime_component(Path(tmp))
            if bare is not None:
                results["runtime_mb"] = round(bare.stat().st_size / 1e6, 2)
                results["image_mb"]["runtime"] = _data_section_bytes(bare.read_bytes())
    n_rss = 8 if opts.quick else 256
    results["rss_mb_per_primed_slot"], results["rss_mb_per_parked"] = rss_per_parked(n_rss)
    results["rss_mb_per_live"] = rss_per_live(n_rss)
    print(json.dumps({k: v for k, v in results.items() if k != "variants"}), flush=True)
    opts.json.write_text(json.dumps(results, indent=1) + "\n")
    opts.json.with_suffix(".md").write_text(table(results))


def table(results: dict[str, Any]) -> str:
    keys = ("start_cpu_ms", "free_cpu_ms", "start_faults", "free_faults", "parallel_cores",
            "first_use_start_cpu_ms", "first_use_free_cpu_ms")
    variants = results["variants"]
    lines = [f"# bench/instance_start.py (text_completion, {results['instances']} instances a round, "
             f"medians of {results['rounds'] - 1} rounds after the first)", "",
             "| per instance | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(str(v.get(k)) for v in variants.values()) + " |")
    lines += ["", f"components (MB): {results['components_mb']}",
              f"bare runtime component (MB): {results.get('runtime_mb')}; memory images (MB): {results['image_mb']}",
              f"resident per primed slot: {results['rss_mb_per_primed_slot']} MB; per parked instance beyond "
              f"its slot: {results['rss_mb_per_parked']} MB; per live instance: {results['rss_mb_per_live']} MB"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
