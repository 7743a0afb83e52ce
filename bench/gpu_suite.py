"""The GPU kit: everything issue 38 measures on a GPU machine, in one invocation.

    python bench/gpu_suite.py --prepare .gpukit         # here (CPU, with a registry): what the GPU box lacks
    python bench/gpu_suite.py --kit .gpukit --out DIR    # on the GPU machine (no registry): one run
    python bench/gpu_suite.py --dry-run --out DIR        # on CPU: every section, tiny shapes (CI runs it)

`--prepare` writes the kit folder: SmolLM2's tokenizer (saved by transformers from the default GGUF),
the built `text_completion` component, and the wheels the GPU machine lacks (wasmtime, llguidance;
it has torch, transformers, tiktoken and jinja2). The run installs the wheels into a temporary
folder, builds its models on the device from `transformers` configs with random weights (weight
values do not change speed): the Llama-3.2-1B and Llama-3.1-8B shapes, with SmolLM2's BPE padded by
placeholder tokens up to Llama 3's 128,256-token vocabulary (the host needs a tokenizer that can
decode every id the model draws); and Qwen3-0.6B's shape (its own config class, q/k norms).

Sections, in this order, each within what is left of `--budget-s` (results are written after each,
so a run cut short keeps what it measured): env (GPU, copy bandwidth), parity (logits vs
transformers, tree mask and hidden token vs separate runs, graphs on == off, overlap on == off),
decode (tokens/s at batch 1 / 8 / 64 / 256 for each attention path, sdpa and triton by default, with
graphs off and on (the other shapes: on), vs transformers with a static cache, vs the HBM bound at
batch 1; last, each path's graphs over compiled layers, `sdpa+graphs+compile`:
`DecodeGraphs(compile_layers=True)`, compiled in each bucket's warm-up, `--no-compile` leaves them out), run256 (256 requests x 256 tokens, the
compiled layers last too; parity checks them against the uncompiled graphs and graphs off), prefill
(tokens/s at 1 x 4,096 and 64 x 512),
host (text_completion through the host vs the backend's own greedy loop at 1 / 64 / 256), workers
(bench/workers.py's closed loop behind a 0 ms stand-in step, workers 0 vs auto), decode8b,
qwen3 (Qwen3-0.6B's shape, SDPA with graphs off and on vs transformers), pytest (`pytest -m gpu` on a small model saved to disk),
agents (bench/agent_io.py at 8 I/Os behind the 1B shape: agents as inferlets vs driven by an OpenAI
client, issue 51; also DIR/agent_io.json). Writes DIR/gpu_suite.json and DIR/gpu_suite.md.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import importlib.util
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repo (no install needed there) and the test checks

# transformers configs (random weights): the shapes the issue names
SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=8192,
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=8192,
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    # Qwen3-0.6B (q/k norms): the model Pie, vLLM and SGLang publish serving numbers for
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1000000.0, max_position_embeddings=8192, rms_norm_eps=1e-6),
    # parity and the pytest model: SmolLM2-135M's shape (the real tokenizer's vocabulary)
    "small": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                  rope_theta=100000.0, max_position_embeddings=8192),
}
# budget left that a measurement over compiled layers needs to start (it may compile its batch bucket first)
COMPILE_MARGIN_S = 90.0
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


@dataclass
class Plan:
    """What a run measures (the dry run shrinks all of it)."""

    dry: bool
    batches: tuple[int, ...] = (1, 8, 64, 256)
    prompt_len: int = 64
    new_tokens: int = 64
    run_reqs: int = 256  # the 256 x 256 run
    run_tokens: int = 256
    host_conc: tuple[int, ...] = (1, 64, 256)
    host_tokens: int = 64
    host_tokens_long: int = 256
    hf_tokens: int = 32
    # "flex" measured on the H100 / H200 before (slower than SDPA + graphs everywhere, fails to compile
    # at batch 1 and on run256): `--attentions sdpa,triton,flex` brings it back
    attentions: tuple[str, ...] = ("sdpa", "triton")
    compile_layers: bool = True  # also measure the decode graphs over compiled layers (DecodeGraphs(compile_layers))
    compile_shapes: tuple[str, ...] = ("llama-1b", "llama-8b", "qwen3-0.6b")  # the decode sections that do
    compile_static_batch: bool = False  # LlamaModel.compile_static_batch: one compile per batch bucket
    compile_batches: tuple[int, ...] | None = None  # the batch sizes decode measures compiled (None: all)
    transformers: bool = True  # decode sections also measure transformers (it compiles per batch size)
    b8_batches: tuple[int, ...] = (1, 8)
    pytest_timeout_s: float = 600.0  # the run gives pytest at most this
    switch_ms: float | None = None  # the host section's HostConfig.switch_interval_ms (None: its default)
    run_slots: int | None = None  # the host section's HostConfig.run_slots (None: its default)
    host_no_ahead: bool = True  # the host section also measures run_ahead off (the baseline of the feed)
    host_config: dict[str, Any] = field(default_factory=dict)  # more HostConfig fields for the host section
    host_workers: tuple[str, ...] = ()  # the host section once per HostConfig.workers value ("0", "auto", ...)
    agents_ios: tuple[int, ...] = (8,)  # the agents section's I/O counts (agent_io.py --ios)
    agents_pages: int = 8192  # its KV pages (16 tokens each): 8 agents' and their peers' transcripts, both ways
    prefill_shapes: tuple[tuple[int, int], ...] = ((1, 4096), (64, 512))  # (requests, prompt tokens)

    @classmethod
    def make(cls, dry: bool) -> Plan:
        if not dry:
            return cls(dry=False)
        return cls(dry=True, batches=(1, 4), prompt_len=8, new_tokens=8, run_reqs=4, run_tokens=4,
                   host_conc=(1, 4), host_tokens=4, host_tokens_long=6, hf_tokens=3, b8_batches=(1,),
                   agents_ios=(2,), agents_pages=1024, prefill_shapes=((1, 32), (4, 16)),
                   # inductor compiles for seconds per shape on CPU: one tiny model, batch dimension
                   # dynamic (parity's compile serves decode's batch 4 and run256's)
                   compile_shapes=("llama-1b",), compile_batches=(4,))


@dataclass
class Suite:
    out: Path
    kit: Path
    plan: Plan
    budget_s: float
    device: str
    t0: float = field(default_factory=time.perf_counter)
    results: dict[str, Any] = field(default_factory=dict)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_suite.json").write_text(json.dumps(self.results, indent=2, default=str))
        (self.out / "gpu_suite.md").write_text(markdown(self.results))


# ---- the kit ------------------------------------------------------------------------------------

KIT_WHEELS = ("wasmtime==50.0.1", "llguidance==1.9.1",
              # the agents section: the server (starlette, uvicorn, websockets) and the OpenAI client
              # (openai and what it needs that the machine's image lacks: KINDS.md's package list)
              "websockets==16.1.1", "starlette==1.10.0", "uvicorn==0.54.0", "openai==3.57.0", "pydantic==2.14.4",
              "pydantic-core==2.50.5", "jiter==0.19.0", "distro==1.9.0", "sniffio==1.3.1", "annotated-types==0.8.0",
              "typing-inspection==0.4.5", "typing-extensions==4.16.0")
KIT_MODULES = ("wasmtime", "llguidance", "websockets", "starlette", "uvicorn", "openai", "pydantic")


def prepare(kit: Path, wheels: bool = True) -> None:
    """Write the kit folder (run here, where the default model is): the tokenizer and the component,
    and with `wheels` what the GPU machine lacks (needs a package registry; the dry run skips it)."""
    import transformers

    from gpu_backend.loading.loader import default_model_path
    from host.cli.build import resolve_inferlet

    kit.mkdir(parents=True, exist_ok=True)
    path = default_model_path()
    transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(kit / "tokenizer")
    # the components gzipped (18 MB -> 6.7 MB each): the kit travels within the device's 64 MiB
    for name, src in (("text_completion", "text_completion"), ("openai_chat", "openai_chat"),
                      ("agent_io", ROOT / "bench" / "inferlets" / "agent_io")):
        (kit / f"{name}.wasm").unlink(missing_ok=True)  # (a kit written before they were gzipped)
        (kit / f"{name}.wasm.gz").write_bytes(gzip.compress(resolve_inferlet(src, quiet=True).read_bytes(), 6))
    if not wheels:
        return
    wheel_dir = kit / "wheels"
    wheel_dir.mkdir(exist_ok=True)
    for spec in KIT_WHEELS:
        for tag in ("manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64"):
            r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                                "--python-version", "3.12", "--implementation", "cp", "--platform", tag,
                                "-d", str(wheel_dir), spec], capture_output=True, text=True)
            if r.returncode == 0:
                break
        else:
            raise SystemExit(f"could not download {spec}: {r.stderr.strip()[-300:]}")
    print(f"kit ready in {kit}: {sorted(p.name for p in kit.rglob('*') if p.is_file())}")


def kit_wasm(kit: Path, name: str) -> bytes:
    """A component the kit carries (NAME.wasm.gz, or NAME.wasm from an older kit)."""
    plain = kit / f"{name}.wasm"
    return plain.read_bytes() if plain.is_file() else gzip.decompress((kit / f"{name}.wasm.gz").read_bytes())


def install_wheels(kit: Path) -> None:
    """Make the kit's wheels importable (the GPU machine has no registry) unless they already are."""
    wheels = sorted((kit / "wheels").glob("*.whl")) if (kit / "wheels").is_dir() else []
    missing = []
    for mod in KIT_MODULES:
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if not missing:
        return
    if not wheels:
        raise SystemExit(f"{missing} not importable and no wheels in {kit}/wheels: run --prepare first")
    target = Path(tempfile.gettempdir()) / "pie-gpu-kit-site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(target), *map(str, wheels)], check=True)
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(target), str(ROOT), os.environ.get("PYTHONPATH", "")])


# ---- models --------------------------------------------------------------------------------------

def tokenizer_spec(kit: Path, vocab: int) -> Any:
    """SmolLM2's BPE from the kit, padded with placeholder tokens up to `vocab` ids (bytes FF FE FD +
    the id: never valid UTF-8, so no real token collides; they decode to replacement characters)."""
    from gpu_backend.loading.hf_dir import _hf_tokenizer
    from gpu_backend.loading.tokenizer import _unicode_to_byte

    spec = _hf_tokenizer(kit / "tokenizer", {})
    chars = {b: c for c, b in _unicode_to_byte().items()}
    extra = [chars[0xFF] + chars[0xFE] + chars[0xFD] + chars[(i >> 16) & 255] + chars[(i >> 8) & 255] + chars[i & 255]
             for i in range(len(spec.tokens), vocab)]
    return replace(spec, tokens=spec.tokens[:vocab] + extra, stop_tokens=[])


def hf_model(shape: str, suite: Suite, dtype: Any) -> Any:
    import torch
    import transformers

    kw = dict(SHAPES[shape])
    if suite.plan.dry:
        kw |= TINY
        kw["vocab_size"] = 49152
    family = "Qwen3" if shape.startswith("qwen3") else "Llama"
    cfg = getattr(transformers, f"{family}Config")(**kw, bos_token_id=1, eos_token_id=2)
    cls = getattr(transformers, f"{family}ForCausalLM")
    torch.manual_seed(0)
    with torch.device(suite.device):
        try:
            m = cls._from_config(cfg, dtype=dtype)
        except TypeError:  # transformers before 4.56 calls it torch_dtype
            m = cls._from_config(cfg, torch_dtype=dtype)
    if not suite.plan.dry:  # the default init (std 0.02) gives near-flat logits: spread them a little
        with torch.no_grad():
            m.model.embed_tokens.weight.normal_(0, 1.0)
    return m.eval()


def ours(hf: Any, suite: Suite, num_pages: int, attention: str = "sdpa", graphs: bool = False,
         dtype: Any = None) -> Any:
    """Our backend over the transformers model's own tensors (fused copies where we fuse). On CPU
    (the dry run) `graphs` leaves one page past `num_pages` in the cache too: `variant` pads with it
    when it runs the compiled layers through graphs' static buffers (`DecodeGraphs(capture=False)`)."""
    import torch

    from gpu_backend.build import backend_from_weights, make_attention
    from gpu_backend.loading.hf_dir import _hf_config

    cfg = _hf_config(hf.config.to_dict())
    dev = torch.device(suite.device)
    dt = dtype or next(hf.parameters()).dtype
    cpu_scratch = graphs and dev.type != "cuda"
    be = backend_from_weights(cfg, dict(hf.state_dict()), tokenizer_spec(suite.kit, cfg.vocab_size), "kit",
                              device=dev, dtype=dt, page_size=16, num_pages=num_pages + cpu_scratch,
                              attention=make_attention(attention), cuda_graphs=graphs and dev.type == "cuda")
    if cpu_scratch:  # the last page is the scratch page: the backend's users never see it
        be.info = replace(be.info, num_pages=num_pages)
    return be


def variant(be: Any, attention: str, graphs: bool, compile_layers: bool = False) -> Any:
    """The same model and cache with another attention path / graphs setting; `compile_layers`: the
    graphs capture the layers compiled by torch.compile (`DecodeGraphs`). On CPU (the dry run) graphs
    stay off, except with `compile_layers`: then the graphs' static-buffer path without capture runs
    the compiled layers (what the GPU captures, checked on CPU)."""
    from gpu_backend import TorchBackend
    from gpu_backend.build import make_attention
    from gpu_backend.cuda_graphs import DecodeGraphs

    attn = make_attention(attention)
    g = None
    if compile_layers and not graphs:
        raise ValueError("compile_layers runs inside the decode graphs: graphs=True")
    cuda = be.model.device.type == "cuda"
    if graphs and (cuda or compile_layers):
        if be.cache.num_pages <= be.info.num_pages:
            raise ValueError("the cache has no scratch page for graphs")
        g = DecodeGraphs(be.model, be.cache, attn, be.info.page_size, scratch_page=be.info.num_pages,
                         capture=cuda, compile_layers=compile_layers)
    return TorchBackend(be.model, be.tokenizer, be.info, be.cache, attn, g)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def own_loop(be: Any, seqs: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Seconds for the backend's own greedy loop (prefill + new_tokens), and its tokens."""
    sync()
    t = time.perf_counter()
    out = be.generate_batch(seqs, new_tokens, stop_tokens=[])
    sync()
    return time.perf_counter() - t, out


def decode_tps(be: Any, batch: int, plan: Plan, reps: int = 2) -> float:
    """Decode tokens/s of the backend's own loop: (full run - prefill-and-first-token run) over the
    decode steps, best of `reps` (a warm-up run first: graph capture, kernel compiles)."""
    seqs = prompts(batch, plan.prompt_len)
    own_loop(be, seqs, plan.new_tokens)
    best = math.inf
    for _ in range(reps):
        full, _ = own_loop(be, seqs, plan.new_tokens)
        first, _ = own_loop(be, seqs, 1)
        best = min(best, max(full - first, 1e-9))
    return batch * (plan.new_tokens - 1) / best


def hf_decode_tps(hf: Any, batch: int, plan: Plan) -> float:
    """transformers' generate with a static cache, greedy, decode tokens/s (same subtraction)."""
    import torch

    ids = torch.tensor(prompts(batch, plan.prompt_len), device=hf.device)

    def gen(n: int) -> float:
        sync()
        t = time.perf_counter()
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0, cache_implementation="static")
        sync()
        return time.perf_counter() - t

    # a static cache makes transformers compile its forward (generation_config.compile_config): the
    # warm-up runs the same lengths, so the measured runs replay what it compiled
    gen(plan.hf_tokens)
    gen(1)
    return batch * (plan.hf_tokens - 1) / max(gen(plan.hf_tokens) - gen(1), 1e-9)


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written (the HBM roofline)."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    a = torch.ones(256 * 2**20, dtype=torch.float32, device="cuda")  # 1 GiB
    b = torch.empty_like(a)
    best = math.inf
    for _ in range(5):
        sync()
        t = time.perf_counter()
        b.copy_(a)
        sync()
        best = min(best, time.perf_counter() - t)
    return 2 * a.numel() * 4 / best


# ---- sections ----------------------------------------------------------------------------------

def sec_env(s: Suite) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": s.device,
                            "dry_run": s.plan.dry}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                 "sms": p.multi_processor_count}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    info["copy_bandwidth_bytes_per_s"] = copy_bandwidth()
    return info


def sec_parity(s: Suite) -> dict[str, Any]:
    """Logits vs transformers (small shape fp32, 1B shape bf16); a tree mask and a hidden token vs
    separate runs; graphs on == off and overlap on == off, token for token (fp32)."""
    import torch
    from backend_checks import check_ragged_batch_equals_each_alone, check_tree_mask_equals_separate_branches
    from parity import PROMPTS, run_parity

    out: dict[str, Any] = {}
    hf = hf_model("small", s, torch.float32)
    be = ours(hf, s, 1024, graphs=True)
    be.model.compile_static_batch = s.plan.compile_static_batch
    out["small_fp32_max_logit_diff"] = run_parity(be, hf, PROMPTS, 8, 1e-2)
    enc = be.tokenizer.encode
    texts = {"a": enc("The quick brown fox jumps over the lazy dog."),
             "b": enc("In 1492, Columbus sailed the ocean blue; in 1969, humans walked on the Moon. Later,"),
             "c": enc("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")}
    first_off: list[list[int]] | None = None
    for attn in s.plan.attentions:
        v = variant(be, attn, False)
        check_ragged_batch_equals_each_alone(v, texts)
        check_tree_mask_equals_separate_branches(v, texts)
        out[f"{attn}_ragged_and_tree_mask"] = "equal"
        out[f"{attn}_hidden_token"] = hidden_token(v, texts["a"])
        seqs = [enc(t)[:12 + 3 * i] for i, t in enumerate(PROMPTS[:5])]
        off = variant(be, attn, False).generate_batch(seqs, 24, stop_tokens=[])
        on = variant(be, attn, True).generate_batch(seqs, 24, stop_tokens=[])
        out[f"{attn}_graphs_on_equals_off"] = on == off
        if first_off is None:
            first_off = off
        else:  # another attention path decodes the same tokens as the first (fp32)
            out[f"{attn}_equals_{s.plan.attentions[0]}"] = off == first_off
        out[f"{attn}_overlap_on_equals_off"] = overlap_equals(variant(be, attn, False), seqs, off)
        if s.plan.compile_layers and attn == s.plan.attentions[0]:
            # the compiled layers (inside the graphs): == the uncompiled graphs, == graphs off (an
            # error here is kept as the result: the checks after it still run)
            try:
                comp = variant(be, attn, True, compile_layers=True).generate_batch(seqs, 24, stop_tokens=[])
                out[f"{attn}_compiled_equals_uncompiled"] = comp == on
                out[f"{attn}_graphs_on_equals_off_compiled"] = comp == off
            except Exception as e:
                out[f"{attn}_compiled_equals_uncompiled"] = f"error: {type(e).__name__}: {str(e)[:300]}"
    del be, hf
    free()
    hf = hf_model("llama-1b", s, torch.bfloat16)
    be = ours(hf, s, 256)
    with torch.inference_mode():
        ids = torch.tensor([prompts(1, 40)[0]], device=hf.device)
        ref = hf(ids).logits[0].float()
    from gpu_backend import ForwardRequest, OutputSpec

    n = ids.shape[1]
    got = be.logits([ForwardRequest(pages=list(range(math.ceil(n / 16))), last_page_len=n - 16 * (math.ceil(n / 16) - 1),
                                    tokens=ids[0].tolist(), positions=list(range(n)),
                                    outputs=[OutputSpec(index=i) for i in range(n)])])[0]
    out["llama1b_bf16_max_logit_diff"] = float((got - ref).abs().max())
    out["llama1b_bf16_logit_scale"] = float(ref.abs().max())
    out["llama1b_bf16_top1_agreement"] = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
    return out


def hidden_token(be: Any, toks: list[int]) -> str:
    """A token masked out of every later row (BRLE) == the same sequence without it, positions kept."""
    from backend_checks import Pages, assert_close, req

    ps = be.info.page_size
    pg = Pages(be, 400)
    k = 3  # hide token k
    n = len(toks)
    mask = [[i + 1] if i <= k else [k, 1, i - k] for i in range(n)]
    full = be.logits([req(pg.for_tokens(64), 0, toks, ps, mask=mask)])[0]
    rest = toks[:k] + toks[k + 1:]
    pos = list(range(k)) + list(range(k + 1, n))
    sep = be.logits([req(pg.for_tokens(64), 0, rest, ps, positions=pos)])[0]
    assert_close(full[k + 1:], sep[k:], "rows after the hidden token")
    return "equal"


def overlap_equals(be: Any, seqs: list[list[int]], want: list[list[int]]) -> bool:
    """The greedy loop with each step started (`start_forward`) while the last one's tokens are read."""
    from gpu_backend import ForwardRequest, OutputSpec, SamplerParams

    ps = be.info.page_size
    pages = [list(range(200 + 8 * i, 208 + 8 * i)) for i in range(len(seqs))]
    toks = [list(q) for q in seqs]
    outs: list[list[int]] = [[] for _ in seqs]
    for step in range(len(want[0])):
        reqs = []
        for i, q in enumerate(toks):
            new = q if step == 0 else q[-1:]
            total = len(q)
            used = math.ceil(total / ps)
            reqs.append(ForwardRequest(pages=pages[i][:used], last_page_len=total - (used - 1) * ps, tokens=new,
                                       positions=list(range(total - len(new), total)),
                                       outputs=[OutputSpec(index=len(new) - 1, sample=SamplerParams())]))
        handle = be.start_forward(reqs)
        for i, t in enumerate(handle.wait()):
            toks[i].append(t[0].token)
            outs[i].append(t[0].token)
    return outs == want


def sec_decode(s: Suite, shape: str = "llama-1b", batches: tuple[int, ...] | None = None) -> dict[str, Any]:
    import torch

    plan = s.plan
    batches = batches or plan.batches
    hf = hf_model(shape, s, torch.bfloat16 if s.device == "cuda" else torch.float32)
    pages = max(batches) * math.ceil((plan.prompt_len + plan.new_tokens) / 16) + 8
    base = ours(hf, s, pages, graphs=True)
    base.model.compile_static_batch = plan.compile_static_batch
    bw = s.results.get("env", {}).get("copy_bandwidth_bytes_per_s", 0.0)
    wb = base.model.weight_bytes()
    out: dict[str, Any] = {"shape": shape, "weight_bytes": wb, "prompt_len": plan.prompt_len,
                           "new_tokens": plan.new_tokens, "tokens_per_s": {}}
    if bw:
        out["batch1_bound_tokens_per_s"] = bw / wb
    # the 1B shape: every attention path with graphs off and on; the others: graphs on only (eager
    # decode is launch-bound, measured on the 1B shape)
    attns = plan.attentions
    graph_settings = (False, True) if shape == "llama-1b" else (True,)
    configs = [(a, g, False) for a in attns for g in graph_settings]
    # the transformers baseline right after the default path (a slow path compiling first goes last)
    if plan.transformers:
        configs.insert(len(graph_settings), ("transformers", False, False))
    # the compiled layers last (skipping them for the budget loses nothing else): each attention's
    # graphs over compiled layers (`--no-compile` leaves them out; the compiled regions exclude
    # attention, so the second attention reuses the first one's compiles)
    if plan.compile_layers and shape in plan.compile_shapes:
        configs += [(a, True, True) for a in attns]
    for attn, graphs, compiled in configs:
        key = f"{attn}{'+graphs' if graphs else ''}{compile_suffix(plan) if compiled else ''}"
        row = out["tokens_per_s"].setdefault(key, {})
        for b in batches:
            if compiled and plan.compile_batches is not None and b not in plan.compile_batches:
                continue
            # (a compiled cell compiles its batch bucket first: tens of seconds on a GPU)
            if s.left() < (COMPILE_MARGIN_S if compiled else 30):
                row[str(b)] = "skipped: budget"
                continue
            try:
                if attn == "transformers":
                    row[str(b)] = round(hf_decode_tps(hf, b, plan), 1)
                else:
                    row[str(b)] = round(decode_tps(variant(base, attn, graphs, compiled), b, plan), 1)
            except Exception as e:  # one failing configuration must not lose the others
                row[str(b)] = f"error: {type(e).__name__}: {str(e)[:300]}"
            s.write()
    if bw:
        best1 = max((v.get("1", 0) for k, v in out["tokens_per_s"].items() if k != "transformers"
                     and isinstance(v.get("1"), float)), default=0.0)
        out["batch1_best_fraction_of_bound"] = best1 / out["batch1_bound_tokens_per_s"]
    del base, hf
    free()
    return out


def compile_suffix(plan: Plan) -> str:
    """The key suffix of a measurement over compiled layers: +compile (batch dimension dynamic) or
    +compile-static (a compile per batch bucket, `--compile-static-batch`)."""
    return "+compile-static" if plan.compile_static_batch else "+compile"


def sec_run256(s: Suite) -> dict[str, Any]:
    """256 requests x 256 new tokens (prompts of `prompt_len`), prefill included, greedy."""
    import torch

    plan = s.plan
    hf = hf_model("llama-1b", s, torch.bfloat16 if s.device == "cuda" else torch.float32)
    pages = plan.run_reqs * math.ceil((plan.prompt_len + plan.run_tokens) / 16) + 8
    base = ours(hf, s, pages, graphs=True)
    base.model.compile_static_batch = plan.compile_static_batch
    seqs = prompts(plan.run_reqs, plan.prompt_len, seed=7)
    out: dict[str, Any] = {"requests": plan.run_reqs, "new_tokens": plan.run_tokens, "prompt_len": plan.prompt_len}
    # every attention with graphs, the first one without (eager decode is launch-bound: its
    # baseline), then the compiled layers (last: skipping them for the budget loses nothing else)
    configs = [(a, True, False) for a in plan.attentions] + [(plan.attentions[0], False, False)]
    if plan.compile_layers:
        configs += [(a, True, True) for a in plan.attentions]
    for attn, graphs, compiled in configs:
        key = f"{attn}{'+graphs' if graphs else ''}{compile_suffix(plan) if compiled else ''}"
        if s.left() < (COMPILE_MARGIN_S if compiled else 40):
            out[key] = "skipped: budget"
            continue
        try:
            v = variant(base, attn, graphs, compiled)
            own_loop(v, seqs[:8], 4)  # warm-up
            secs, toks = own_loop(v, seqs, plan.run_tokens)
            out[key] = {"seconds": round(secs, 3), "tokens_per_s": round(sum(map(len, toks)) / secs, 1)}
        except Exception as e:
            out[key] = f"error: {type(e).__name__}: {str(e)[:300]}"
        s.write()
    del base, hf
    free()
    return out


def sec_prefill(s: Suite) -> dict[str, Any]:
    """Prefill tokens/s of the 1B shape: `prefill_shapes` (requests x prompt tokens, 1 x 4,096 and
    64 x 512), each request's whole prompt in one forward, first token sampled; best of two after a
    warm-up. Prefill batches run eagerly through SDPA whatever the attention path (the triton path
    hands them to SDPA), so one path is measured."""
    import torch

    plan = s.plan
    hf = hf_model("llama-1b", s, torch.bfloat16 if s.device == "cuda" else torch.float32)
    pages = max(n * math.ceil((length + 1) / 16) for n, length in plan.prefill_shapes) + 8
    be = ours(hf, s, pages)
    out: dict[str, Any] = {"shape": "llama-1b", "tokens_per_s": {}, "forward_s": {}}
    for n, length in plan.prefill_shapes:
        key = f"{n}x{length}"
        if s.left() < 30:
            out["tokens_per_s"][key] = "skipped: budget"
            continue
        try:
            seqs = prompts(n, length, seed=11)
            own_loop(be, seqs, 1)  # warm-up
            secs = min(own_loop(be, seqs, 1)[0] for _ in range(2))
            out["tokens_per_s"][key] = round(n * length / secs, 1)
            out["forward_s"][key] = round(secs, 4)
        except Exception as e:
            out["tokens_per_s"][key] = f"error: {type(e).__name__}: {str(e)[:300]}"
        s.write()
    del be, hf
    free()
    return out


def sec_host(s: Suite) -> dict[str, Any]:
    """text_completion through the host (the real backend) vs the backend's own greedy loop, same
    prompts (the chat-templated prompt's tokens), same token counts: the default host (run ahead;
    the torch backend takes a `Feed`, so batches of loops go one ahead, their tokens read on the
    device) and run_ahead off. `concurrency`: `host_tokens` new tokens each (the ramp of n starts
    weighs in); `concurrency_long`: `host_tokens_long` each, default host only."""
    import torch

    from host import Host, HostConfig

    plan = s.plan
    wasm = kit_wasm(s.kit, "text_completion")
    hf = hf_model("llama-1b", s, torch.bfloat16 if s.device == "cuda" else torch.float32)
    n_max = max(plan.host_conc)
    longest = max(plan.host_tokens, plan.host_tokens_long)
    pages = n_max * math.ceil((64 + longest) / 16) + 64
    be = ours(hf, s, pages, graphs=True)
    assert be.info.stop_tokens == []  # (tokenizer_spec): every loop runs to its max tokens
    del hf
    out: dict[str, Any] = {"new_tokens": plan.host_tokens, "long_new_tokens": plan.host_tokens_long,
                           "fed": bool(be.feeds), "concurrency": {}, "concurrency_long": {}}
    # how often a thread waiting for the GIL gets it from one that runs Python (HostConfig)
    switch: dict[str, Any] = {} if plan.switch_ms is None else {"switch_interval_ms": plan.switch_ms}
    if plan.run_slots is not None:  # instance threads running at once (host/batching/gate.py)
        switch["run_slots"] = plan.run_slots
    switch.update(plan.host_config)
    out["host_config"] = dict(plan.host_config)
    prompt = "Write a short story about a robot learning to paint."
    seq = be.tokenizer.encode(be.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]))
    from common import BatchLog

    log = BatchLog(be)  # before the host binds the backend's methods: every backend call is timed
    runs = [(True, "concurrency", plan.host_tokens), (True, "concurrency_long", plan.host_tokens_long),
            (False, "concurrency", plan.host_tokens)]
    # --workers: the whole section once per value, each in `by_workers` (the first also as the tables
    # above); without it, the host's default
    for i, workers in enumerate(plan.host_workers or (None,)):
        config = dict(switch) if workers is None else {**switch, "workers": _workers_value(workers)}
        tables = out if workers is None else {"concurrency": {}, "concurrency_long": {}}
        if i == 0 and workers is not None:  # (the same tables: the JSON repeats them)
            out["concurrency"], out["concurrency_long"] = tables["concurrency"], tables["concurrency_long"]
        for ahead in (True, False) if plan.host_no_ahead else (True,):
            with tempfile.TemporaryDirectory() as data:
                host = Host(HostConfig(data_dir=Path(data), run_ahead=ahead, prefix_cache="off", **config),
                            backend=be)
                out["switch_interval_ms"] = round(sys.getswitchinterval() * 1000, 3)
                out["run_slots"] = host.config.run_slots
                if workers is not None:
                    tables["workers"] = host.config.worker_count
                if workers is not None:
                    out.setdefault("by_workers", {})[workers] = tables
                try:
                    program = host.compile(wasm)
                    for _, table, tokens in [r for r in runs if r[0] == ahead]:
                        for n in plan.host_conc:
                            if s.left() < 30:
                                break
                            row = tables[table].setdefault(str(n), {})
                            row.update(host_tax(be, log, host, program, seq, n, tokens, "host_ahead" if ahead
                                                else "host_no_ahead"))
                            s.write()
                finally:
                    host.shutdown()
    del be
    free()
    return out


def host_tax(be: Any, log: Any, host: Any, program: str, seq: list[int], n: int, tokens: int,
             key: str) -> dict[str, Any]:
    """n instances of text_completion vs the own loop over n copies of `seq`, `tokens` new each:
    alternating, best of 2 each (the two sides see the same machine), after a warm-up of each."""
    args = ["--prompt", "Write a short story about a robot learning to paint.", "--max-tokens", str(tokens)]
    want = be.tokenizer.decode(own_loop(be, [seq] * n, tokens)[1][0])  # warm-up (graphs for this bucket)
    texts = host_run(host, program, args, n, tokens)[2]  # warm-up (the warm pool learns n)
    own_s = host_s = math.inf
    own_p: list[float] = []
    host_p: list[float] = []
    graphs = len(be.graphs.captured()) if be.graphs is not None else 0
    for _ in range(2):
        log.calls.clear()
        own_s = min(own_s, own_loop(be, [seq] * n, tokens)[0])
        own_p += log.periods_ms(n)
        log.calls.clear()
        secs, _, _, t0, launched = host_run(host, program, args, n, tokens)
        if secs < host_s:
            host_s, where = secs, phases_ms(log.calls, t0, t0 + secs, n)
            where["launches"] = round(1000 * (launched - t0), 2)  # the n launches, one after the other
        host_p += log.periods_ms(n)
    row: dict[str, Any] = {key + "_own_tokens_per_s": round(n * tokens / own_s, 1),
                           # the host's texts against the own loop's (bf16: batches of other shapes may differ)
                           key + "_texts_equal_own": round(sum(t == want for t in texts) / n, 3),
                           key + "_tokens_per_s": round(n * tokens / host_s, 1),
                           key + "_tax": round(1 - own_s / host_s, 4)}
    row[key + "_phases_ms"] = where
    # CUDA graphs captured during the measured runs (a capture on the way costs tens of ms)
    row[key + "_graphs_captured"] = (len(be.graphs.captured()) if be.graphs is not None else 0) - graphs
    # the steady state: start-to-start period of the backend calls holding all n loops
    if own_p and host_p:
        o, h = statistics.median(own_p), statistics.median(host_p)
        row[key + "_step_ms"] = {"own": round(o, 3), "host": round(h, 3)}
        row[key + "_step_tax"] = round(1 - o / h, 4)
    return row


def phases_ms(calls: list[tuple[float, float, int]], t0: float, t1: float, n: int) -> dict[str, Any]:
    """Where a host run's time went, from its backend calls (start, end, size): to the first call, the
    ramp to the first call holding all n, the calls holding all n, and the rest to the end."""
    c = sorted(calls)
    if not c:
        return {}
    full = [k for k, x in enumerate(c) if x[2] == n]
    a = c[full[0]][0] if full else c[-1][1]
    b = c[full[-1]][1] if full else c[-1][1]
    def ms(seconds: float) -> float:
        return round(1000 * seconds, 2)

    return {"to_first_call": ms(c[0][0] - t0), "ramp": ms(a - c[0][0]), "full": ms(b - a), "full_calls": len(full),
            "tail": ms(t1 - b), "calls": len(c),
            # the first calls: (start from the run's start, size, start to wait's return), ms
            "first_calls": [(ms(x[0] - t0), x[2], ms(x[1] - x[0])) for x in c[:8]]}


def host_run(host: Any, program: str, args: list[str], n: int,
             tokens: int) -> tuple[float, int, list[str], float, float]:
    """n instances at once; seconds from the first launch to the last end, and tokens generated (no
    stop tokens: each instance generates its `tokens`; the own loop's `generate_batch` the same)."""
    from common import Run

    t = time.perf_counter()
    runs = [Run(host, program, args) for _ in range(n)]
    launched = time.perf_counter()
    ends = [r.finish(600) for r in runs]
    secs = time.perf_counter() - t
    bad = [e for e in ends if e.event != "completed"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {n} instances did not complete: {bad[0].event} {bad[0].message[:300]}")
    if not all(e.message for e in ends):
        raise RuntimeError("an instance returned no text")
    return secs, n * tokens, [e.message for e in ends], t, launched


def sec_agents(s: Suite) -> dict[str, Any]:
    """bench/agent_io.py behind the 1B shape on the GPU (graphs on): every kind at `agents_ios` I/Os,
    as an inferlet and as a client-driven agent over the OpenAI endpoint (issue 51's dividend where a
    model step is a GPU's). Random weights and no stop token: both ways generate exactly T tokens a
    turn. Its JSON is written to OUT/agent_io.json; the section keeps the targets and the rows."""
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import agent_io

    hf = hf_model("llama-1b", s, torch.bfloat16 if s.device == "cuda" else torch.float32)
    be = ours(hf, s, s.plan.agents_pages, graphs=True)
    assert be.info.stop_tokens == []
    del hf
    out = s.out / "agent_io.json"
    argv = ["--ios", *map(str, s.plan.agents_ios), "--json", str(out)] + (["--quick"] if s.plan.dry else [])
    try:
        agent_io.main(argv, backend=be, wasm=(kit_wasm(s.kit, "agent_io"), kit_wasm(s.kit, "openai_chat")))
    finally:
        del be
        free()
    doc = json.loads(out.read_text())
    return {"json": str(out), "config": doc["config"], "targets": doc["targets"],
            "rows": [{k: r[k] for k in ("kind", "ios", "tool_ms", "agents", "latency_ratio", "throughput_ratio")}
                     | {f"{w}_{m}": r[w][m] for w in ("inferlet", "client") for m in ("latency_s_median", "agents_per_s")}
                     for r in doc["results"]]}


def sec_workers(s: Suite) -> dict[str, Any]:
    """Issue 49's closed loop on this machine's cores (bench/workers.py, the kit's text_completion):
    64 clients each running `text_completion --raw` (16 new tokens) again and again behind a 0 ms
    stand-in step, workers 0 vs auto (one per core), 2 rounds alternated; `ratio` is auto's
    completions/s over in-process's."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("bench_workers", ROOT / "bench" / "workers.py")
    assert spec is not None and spec.loader is not None
    wb = iu.module_from_spec(spec)
    spec.loader.exec_module(wb)
    dry = s.plan.dry
    opts = argparse.Namespace(workers=[0, 1] if dry else [0, "auto"], clients=8 if dry else 64, tokens=16,
                              step_ms=0.0, warmup=1.0 if dry else 3.0, seconds=1.0 if dry else 5.0,
                              rounds=1 if dry else 2)
    out = dict(wb.measure(opts, kit_wasm(s.kit, "text_completion")))
    out["window_s"] = out.pop("seconds")  # ("seconds" is the section's own time in the kit's JSON)
    return out


def sec_decode8b(s: Suite) -> dict[str, Any]:
    return sec_decode(s, "llama-8b", s.plan.b8_batches)


def sec_qwen3(s: Suite) -> dict[str, Any]:
    """Qwen3-0.6B's shape at every batch size (its serving numbers are the ones the field publishes)."""
    return sec_decode(s, "qwen3-0.6b")


def sec_pytest(s: Suite) -> dict[str, Any]:
    """`pytest -m gpu` with PIE_TEST_MODEL = the small shape saved (random weights, the real tokenizer)."""
    import torch

    with tempfile.TemporaryDirectory() as d:
        hf = hf_model("small", s, torch.float32)
        hf.save_pretrained(d)
        del hf
        free()
        import transformers

        transformers.AutoTokenizer.from_pretrained(s.kit / "tokenizer").save_pretrained(d)
        env = dict(os.environ, PIE_TEST_MODEL=d)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
        files = ["tests/test_backend_gpu.py", "tests/test_backend_graphs.py", "tests/test_backend_swap.py",
                 "tests/test_backend_load.py", "tests/test_compiled_layers.py"]
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *files]
        try:
            r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                               timeout=max(30.0, min(s.left() - 10, s.plan.pytest_timeout_s)))
            tail = (r.stdout + r.stderr)[-3000:]
            return {"returncode": r.returncode, "summary": tail.strip().splitlines()[-1] if tail.strip() else "",
                    "output_tail": tail}
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            return {"returncode": "timeout", "output_tail": out[-3000:]}


SECTIONS: dict[str, Callable[[Suite], dict[str, Any]]] = {
    "env": sec_env, "parity": sec_parity, "decode": sec_decode, "run256": sec_run256, "prefill": sec_prefill,
    "host": sec_host, "workers": sec_workers,
    "decode8b": sec_decode8b, "qwen3": sec_qwen3, "pytest": sec_pytest, "agents": sec_agents,
}  # the default order; --sections picks and orders


def _cell(v: Any) -> str:
    """A table cell: an error's first line, shortened."""
    text = str(v).splitlines()[0] if str(v) else ""
    return text if len(text) <= 90 else text[:87] + "..."


def markdown(res: dict[str, Any]) -> str:
    lines = ["# GPU suite", ""]
    env = res.get("env", {})
    lines.append(f"{env.get('gpu', env.get('device', '?'))}, torch {env.get('torch', '?')}, "
                 f"copy bandwidth {env.get('copy_bandwidth_bytes_per_s', 0) / 1e12:.2f} TB/s"
                 f"{' (dry run)' if env.get('dry_run') else ''}")
    for key in ("decode", "decode8b", "qwen3"):
        d = res.get(key)
        if not isinstance(d, dict) or "tokens_per_s" not in d:
            continue
        lines += ["", f"## {key}: {d['shape']} decode tokens/s (prompt {d['prompt_len']}, {d['new_tokens']} new)", ""]
        cols = sorted({b for row in d["tokens_per_s"].values() for b in row}, key=int)
        lines += ["| path | " + " | ".join(f"batch {c}" for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
        for name, row in d["tokens_per_s"].items():
            lines.append(f"| {name} | " + " | ".join(_cell(row.get(c, "")) for c in cols) + " |")
        if "batch1_bound_tokens_per_s" in d:
            lines.append(f"\nHBM bound at batch 1: {d['batch1_bound_tokens_per_s']:.0f} tokens/s; best of ours "
                         f"{d.get('batch1_best_fraction_of_bound', 0):.0%} of it")
    r = res.get("run256")
    if isinstance(r, dict):
        lines += ["", f"## {r.get('requests')} requests x {r.get('new_tokens')} tokens (1B shape)", ""]
        for k, v in r.items():
            if isinstance(v, dict):
                lines.append(f"- {k}: {v['tokens_per_s']} tokens/s ({v['seconds']} s)")
            elif k not in ("requests", "new_tokens", "prompt_len"):
                lines.append(f"- {k}: {v}")
    pf = res.get("prefill")
    if isinstance(pf, dict) and pf.get("tokens_per_s"):
        lines += ["", "## prefill tokens/s (1B shape; requests x prompt tokens, one forward)", ""]
        lines += [f"- {k}: {_cell(v)}" + (f" ({pf['forward_s'][k]} s)" if k in pf.get("forward_s", {}) else "")
                  for k, v in pf["tokens_per_s"].items()]
    w = res.get("workers")
    if isinstance(w, dict) and w.get("settings"):
        lines += ["", f"## workers: closed loop, {w.get('clients')} clients, {w.get('step_ms')} ms stand-in step, "
                  f"{w.get('cores')} cores", "", "| workers | processes | completions/s (rounds) | ratio |", "|---|---|---|---|"]
        lines += [f"| {k} | {e.get('worker_processes')} | {e.get('completions_s')} ({e.get('rounds')}) | {e.get('ratio')} |"
                  for k, e in w["settings"].items()]
    h = res.get("host")
    if isinstance(h, dict) and h.get("concurrency"):
        lines += ["", "## host tax (text_completion through the host vs the backend's own loop, 1B shape)", "",
                  "| concurrent | own tok/s | host, ahead | tax | own tok/s | host, no ahead | tax |",
                  "|---|---|---|---|---|---|---|"]
        for n, row in h["concurrency"].items():
            lines.append(" | ".join([f"| {n}"] + [str(row.get(f"host_{k}_{c}")) for k in ("ahead", "no_ahead")
                                                  for c in ("own_tokens_per_s", "tokens_per_s", "tax")]) + " |")
        lines += ["", f"Per token count ({h.get('new_tokens')} / {h.get('long_new_tokens')} new each; default host, "
                  f"fed: {h.get('fed')}): end-to-end tax, and the steady state's (median start-to-start period "
                  "of the backend calls holding all n loops, own / host ms)", "",
                  "| concurrent | tax | step tax | step ms | tax, long | step tax, long | step ms, long |",
                  "|---|---|---|---|---|---|---|"]
        for n, row in h["concurrency"].items():
            long = h.get("concurrency_long", {}).get(n, {})
            lines.append(" | ".join([f"| {n}"] + [str(r.get(f"host_ahead_{c}")) for r in (row, long)
                                                  for c in ("tax", "step_tax", "step_ms")]) + " |")
    if isinstance(h, dict) and h.get("by_workers"):
        lines += ["", "## host tax by HostConfig.workers (default host: run ahead)", "",
                  "| workers | processes | concurrent | own tok/s | host tok/s | tax | step tax | tax, long |",
                  "|---|---|---|---|---|---|---|---|"]
        for w, t in h["by_workers"].items():
            for n, row in t.get("concurrency", {}).items():
                long = t.get("concurrency_long", {}).get(n, {})
                lines.append(" | ".join([f"| {w}", str(t.get("workers")), n]
                                        + [str(row.get(f"host_ahead_{c}")) for c in ("own_tokens_per_s", "tokens_per_s",
                                                                                     "tax", "step_tax")]
                                        + [str(long.get("host_ahead_tax"))]) + " |")
    ag = res.get("agents")
    if isinstance(ag, dict) and ag.get("rows"):
        lines += ["", "## agents (agent_io.py, 1B shape): inferlet vs client-driven over the OpenAI endpoint", "",
                  "| kind | ios | tool ms | agents | inferlet latency s | client latency s | latency x | "
                  "inferlet agents/s | client agents/s | throughput x |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in ag["rows"]:
            lines.append(f"| {r['kind']} | {r['ios']} | {r['tool_ms']:g} | {r['agents']} | "
                         f"{r['inferlet_latency_s_median']:.3f} | {r['client_latency_s_median']:.3f} | "
                         f"{r['latency_ratio']:.2f} | {r['inferlet_agents_per_s']:.3f} | "
                         f"{r['client_agents_per_s']:.3f} | {r['throughput_ratio']:.2f} |")
        tg = next((v for k, v in ag.get("targets", {}).items() if k.startswith("ios_")), None)
        if tg:
            lines.append(f"\nTargets at {tg['ios']} I/Os: latency x{tg['latency_ratio_min']:.2f} (>= 1.15), "
                         f"throughput x{tg['throughput_ratio_min']:.2f} (>= 1.3): {'met' if tg['met'] else 'not met'}")
    for key in ("parity", "pytest"):
        if key in res:
            lines += ["", f"## {key}", "", "```", json.dumps(res[key], indent=1, default=str)[:4000], "```"]
    errs = {k: v for k, v in res.items() if isinstance(v, dict) and "error" in v}
    if errs:
        lines += ["", "## errors", ""] + [f"- {k}: {v['error']}" for k, v in errs.items()]
    return "\n".join(lines) + "\n"


def _workers_value(text: str) -> int | str:
    """A --workers value as HostConfig.workers takes it: a count, or "auto"."""
    return text if text == "auto" else int(text)


def _config_field(kv: str) -> tuple[str, Any]:
    """`FIELD=VALUE` of --host-config: VALUE as JSON (true, 0.5, "x"), else the string itself."""
    from host import HostConfig

    name, sep, value = kv.partition("=")
    if not sep or name not in HostConfig.__dataclass_fields__:
        raise ValueError(f"--host-config {kv!r}: expected FIELD=VALUE with a HostConfig field")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="write gpu_suite.json and gpu_suite.md here")
    ap.add_argument("--kit", type=Path, default=ROOT / ".gpukit", help="the kit folder (--prepare writes it)")
    ap.add_argument("--prepare", type=Path, metavar="KIT", help="write the kit folder and exit")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: every section end to end")
    ap.add_argument("--budget-s", type=float, default=1140.0, help="stop starting measurements after this")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {','.join(SECTIONS)}")
    ap.add_argument("--pytest-timeout-s", type=float, default=600.0, help="the most the pytest section may take")
    ap.add_argument("--host-switch-ms", type=float, default=None,
                    help="the host section's GIL switch interval (HostConfig.switch_interval_ms; default: the "
                         "host's; 0: Python's 5 ms)")
    ap.add_argument("--host-run-slots", type=int, default=None,
                    help="the host section's instance threads running at once (HostConfig.run_slots; default: the host's)")
    ap.add_argument("--host-config", action="append", default=[], metavar="FIELD=VALUE",
                    help="a HostConfig field for the host section (repeatable), e.g. run_slots=8")
    ap.add_argument("--workers", nargs="+", default=[], metavar="N|auto",
                    help="the host section once per value of HostConfig.workers (instance worker processes), "
                         "e.g. --workers 0 auto: in-process against the default; results in host.by_workers")
    ap.add_argument("--attentions", default=None, metavar="A,B",
                    help="the attention paths parity, decode and run256 measure, comma-separated (default: "
                         "sdpa,triton; the dry run runs triton in Triton's interpreter, or leaves it out where "
                         "triton is not installed); the first is the one parity's compiled checks run with")
    ap.add_argument("--no-compile", action="store_true",
                    help="leave out the measurements over compiled layers (decode graphs with "
                         "compile_layers: sdpa+graphs+compile in decode and run256, the compiled parity checks)")
    ap.add_argument("--no-transformers", action="store_true",
                    help="decode sections leave out the transformers baseline (it compiles its forward per batch "
                         "size: minutes of a short device lease)")
    ap.add_argument("--compile-static-batch", action="store_true",
                    help="the compiled layers with a static batch dimension: one compile per batch bucket "
                         "(LlamaModel.compile_static_batch; default: dynamic, one compile for every bucket but 1)")
    ap.add_argument("--host-ahead-only", action="store_true",
                    help="the host section measures the default host only, not also with run_ahead off")
    a = ap.parse_args(argv)
    if a.prepare:
        prepare(a.prepare)
        return 0
    if a.out is None:
        ap.error("--out is required (or --prepare KIT)")
    try:
        host_config = dict(_config_field(kv) for kv in a.host_config)
        for w in a.workers:
            if w != "auto" and int(w) < 0:
                raise ValueError(f"--workers {w}: a count >= 0, or auto")
    except ValueError as e:
        ap.error(str(e))
    attentions = tuple(x for x in (a.attentions or "").split(",") if x)
    if a.attentions is not None:
        from gpu_backend.build import ATTENTION_NAMES

        if not attentions or set(attentions) - set(ATTENTION_NAMES):
            ap.error(f"--attentions {a.attentions!r}: use some of {','.join(ATTENTION_NAMES)}")
    if a.dry_run:  # the triton path on CPU: Triton's interpreter, set before triton is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    names = [n for n in a.sections.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        ap.error(f"unknown sections {unknown}: use {','.join(SECTIONS)}")
    kit = a.kit
    if a.dry_run and not (kit / "tokenizer").is_dir():
        kit = Path(tempfile.mkdtemp(prefix="pie-gpu-kit-"))
        prepare(kit, wheels=False)
    install_wheels(kit)
    import torch

    device = "cpu" if a.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device: run on the GPU machine, or use --dry-run on CPU")
    suite = Suite(out=a.out, kit=kit, plan=replace(Plan.make(a.dry_run), pytest_timeout_s=a.pytest_timeout_s,
                                                      switch_ms=a.host_switch_ms, run_slots=a.host_run_slots,
                                                      host_no_ahead=not a.host_ahead_only, host_config=host_config,
                                                      host_workers=tuple(a.workers)),
                  budget_s=a.budget_s, device=device)
    if a.dry_run and not attentions and importlib.util.find_spec("triton") is None:
        suite.plan = replace(suite.plan, attentions=("sdpa",))
    if attentions:
        suite.plan = replace(suite.plan, attentions=attentions)
    if a.no_compile:
        suite.plan = replace(suite.plan, compile_layers=False)
    suite.plan = replace(suite.plan, compile_static_batch=a.compile_static_batch, transformers=not a.no_transformers)
    failed = 0
    for name in names:
        if name != "env" and suite.left() < 20:
            suite.results[name] = {"error": "skipped: out of budget"}
            continue
        t = time.perf_counter()
        try:
            res = SECTIONS[name](suite)
            res["seconds"] = round(time.perf_counter() - t, 1)
            suite.results[name] = res
        except Exception as e:
            failed += 1
            suite.results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:],
                                   "seconds": round(time.perf_counter() - t, 1)}
        print(f"[gpu_suite] {name}: {time.perf_counter() - t:.1f} s, {suite.left():.0f} s left", flush=True)
        suite.write()
    print(markdown(suite.results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
