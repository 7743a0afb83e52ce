"""Read a GGUF file: architecture, tokenizer and weights, dequantized under HF names.

Weights are dequantized by the `gguf` package (`gguf.quants`: F32, F16, BF16, Q4_0 ... Q8_0, the
K-quants Q2_K ... Q6_K, the IQ types) one tensor at a time, each cast at once to the serving dtype,
so a bf16 run never holds a float32 copy of the model. Dequantizing costs seconds, so the result
is cached on disk (`$PIE_CACHE_DIR`, default `~/.cache/pie-python/`), in that dtype, keyed by the
file's path, size and mtime and the dtype; later loads read the cache with safetensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from gpu_backend.loading.gguf_vocab import gemma_pieces, sentencepiece_json
from gpu_backend.loading.hf_dir import unfuse
from gpu_backend.loading.model_files import GGUF_PRE_PATTERNS, LoadedModel, TokenizerSpec
from gpu_backend.loading.paths import default_cache_dir
from gpu_backend.models.config import ModelConfig

__all__ = ["CACHE_VERSION", "load_gguf_cached"]

log = logging.getLogger(__name__)

CACHE_VERSION = 3  # 2: TokenizerSpec.add_bos; 3: weights in the serving dtype, which is in the key
# kept in float32 whatever the serving dtype: Llama 3's RoPE frequency divisors (the RoPE tables are
# computed in float32 from them, as transformers computes its frequencies)
_FLOAT32_TENSORS = ("rope_freqs",)


def _cache_key(path: Path, dtype: torch.dtype) -> str:
    st = path.stat()
    raw = f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def load_gguf_cached(path: Path, progress: bool, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a GGUF file with its weights in `dtype`, from the disk cache of its dequantized weights
    when there is one."""
    base = default_cache_dir() / f"{path.stem}-{str(dtype).removeprefix('torch.')}-{_cache_key(path, dtype)}"
    # the key is in the name; with_suffix would cut it off after a dot in the model file's stem
    meta_file, weight_file = base.parent / f"{base.name}.json", base.parent / f"{base.name}.safetensors"
    if meta_file.exists() and weight_file.exists():
        meta = json.loads(meta_file.read_text())
        with tqdm(total=1, desc=f"loading {path.name} (cached)", disable=not progress) as bar:
            weights = load_file(str(weight_file))
            bar.update(1)
        return LoadedModel(
            meta["name"], ModelConfig.from_dict(meta["config"]), weights, TokenizerSpec(**meta["tokenizer"])
        )
    loaded = _load_gguf(path, progress, dtype)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        tmp = weight_file.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(tmp))
        os.replace(tmp, weight_file)
        meta = {"name": loaded.name, "config": loaded.config.to_dict(), "tokenizer": asdict(loaded.tokenizer)}
        meta_file.write_text(json.dumps(meta))
    except OSError as e:  # a read-only home must not stop the load; it only makes the next one slower
        log.warning("could not write the weight cache %s: %s", base, e)
    return loaded


SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3")
# GGUF value types: byte sizes of the fixed-size ones; 8 = string, 9 = array
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_architecture(path: Path) -> str | None:
    """`general.architecture` of a GGUF file, read from the header without parsing the rest (the
    tokenizer's vocabulary takes seconds to parse); None if the file does not name one."""
    with path.open("rb") as f:
        def u(fmt: str) -> int:
            return int(struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0])

        def text() -> str:
            return f.read(u("<Q")).decode("utf-8", errors="replace")

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(u("<Q"), 1)
            elif vtype == 9:
                item, count = u("<I"), u("<Q")
                if item in _SCALAR_BYTES:
                    f.seek(_SCALAR_BYTES[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            elif vtype in _SCALAR_BYTES:
                f.seek(_SCALAR_BYTES[vtype], 1)
            else:
                raise ValueError(f"{path}: GGUF value type {vtype} unknown")

        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        if u("<I") < 2:
            raise ValueError(f"{path}: GGUF version 1 is not supported")
        u("<Q")  # tensor count
        for _ in range(u("<Q")):
            key, vtype = text(), u("<I")
            if key == "general.architecture" and vtype == 8:
                return text()
            skip(vtype)
    return None


def check_architecture(path: Path) -> str:
    """The file's architecture; ValueError naming it and the supported ones unless we run it."""
    arch = gguf_architecture(path)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path.name}: supported are "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)} (or load the model's HF safetensors directory)")
    return arch


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the rotary halves of q/k rows; undo it so HF's rotate_half applies.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Phi-3's fused projections (split into q/k/v and gate/up after loading, as from an HF directory)
_GGUF_PHI3_NAMES = _GGUF_NAMES | {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
# Gemma's four norms a layer: ffn_norm is the one before the MLP there (Llama's post_attention_layernorm)
_GGUF_SANDWICH_NAMES = _GGUF_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _gguf_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}: supported are {', '.join(SUPPORTED_ARCHITECTURES)}")

    def g(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor", 1.0))}
    layers = int(g("block_count"))
    head_dim = int(g("attention.key_length") or g("rope.dimension_count") or hidden // heads)
    return ModelConfig(
        arch=arch,
        num_layers=layers,
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=head_dim,
        vocab_size=int(vocab),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        **({"max_position": int(g("context_length", 4096)), "rope_scaling": scaling}
           | (_gemma(arch, g, layers, hidden, heads, head_dim) if arch in _GEMMA_SWA_PATTERN else {})
           | (_phi3(reader, g) if arch == "phi3" else {})),
    )


def _phi3(reader: Any, g: Any) -> dict[str, Any]:
    """Phi-3 as llama.cpp writes it: a window on every layer; longrope as factor tensors (without the
    long ones, the context stops where transformers would switch to them, as from an HF directory)."""
    out: dict[str, Any] = {"sliding_window": int(g("attention.sliding_window", 0) or 0)}
    factors = {t.name: [float(x) for x in np.asarray(t.data)] for t in reader.tensors
               if t.name in ("rope_factors_short.weight", "rope_factors_long.weight")}
    if "rope_factors_short.weight" in factors:
        orig, ctx = int(g("rope.scaling.original_context_length")), int(g("context_length", 0))
        ctx = ctx or orig
        scaling: dict[str, Any] = {"rope_type": "longrope", "short_factor": factors["rope_factors_short.weight"],
                                   "original_max_position_embeddings": orig, "factor": ctx / orig}
        if "rope_factors_long.weight" in factors:
            scaling["long_factor"] = factors["rope_factors_long.weight"]
        if g("rope.scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(g("rope.scaling.attn_factor"))
        out |= {"rope_scaling": scaling, "max_position": ctx if "long_factor" in scaling else min(ctx, orig)}
    return out


# Gemma as llama.cpp writes and runs it: norms stored as 1 + w (so no offset here), the sliding
# layers every other one (Gemma 2) or five in six (Gemma 3, whose sliding layers use RoPE base 10000),
# the query scale 1 / sqrt(head_dim) except for the 27B models (1 / sqrt(hidden / heads)).
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma(arch: str, g: Any, layers: int, hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    pattern = int(g("attention.sliding_window_pattern", _GEMMA_SWA_PATTERN[arch]))
    caps = {k: None if g(k) is None else float(g(k)) for k in ("attn_logit_softcapping", "final_logit_softcapping")}
    scale_dim = hidden / heads if layers == _GEMMA_27B_LAYERS[arch] else head_dim
    return dict(
        sandwich_norms=True, embed_scale=hidden**0.5, activation="gelu_tanh", attn_scale=scale_dim**-0.5,
        attn_softcap=caps["attn_logit_softcapping"], final_softcap=caps["final_logit_softcapping"],
        sliding_window=int(g("attention.sliding_window", 0) or 0),
        sliding_layers=tuple((i + 1) % pattern != 0 for i in range(layers)),
        local_rope_theta=float(g("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None,
    )


def _gguf_tokenizer(reader: Any, arch: str) -> TokenizerSpec:
    model = _field(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer {model!r}: supported are gpt2 (byte-level BPE) and llama "
                         "(SentencePiece BPE)")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    sp = None
    if model == "llama":
        scores = [float(x) for x in _field(reader, "tokenizer.ggml.scores")]
        if arch.startswith("gemma"):
            tokens, scores = gemma_pieces(tokens)
        sp = sentencepiece_json(arch, tokens, scores, types, bool(_field(reader, "tokenizer.ggml.add_space_prefix", True)))
    elif pre not in GGUF_PRE_PATTERNS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}: known {sorted(GGUF_PRE_PATTERNS)}")
    # type 3 = control, 4 = user-defined: both are matched verbatim in text, like HF added tokens.
    special = {tok: i for i, (tok, t) in enumerate(zip(tokens, types, strict=True)) if t in (3, 4)}
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "pad", "eot", "eom")}
    stops = sorted({int(ids[k]) for k in ("eos", "eot", "eom") if ids[k] is not None})
    return TokenizerSpec(
        tokens=tokens,
        special=special,
        pattern="" if sp is not None else GGUF_PRE_PATTERNS[pre],
        chat_template=_field(reader, "tokenizer.chat_template", "") or "",
        bos_token_id=None if ids["bos"] is None else int(ids["bos"]),
        eos_token_id=None if ids["eos"] is None else int(ids["eos"]),
        pad_token_id=None if ids["pad"] is None else int(ids["pad"]),
        stop_tokens=stops,
        # llama.cpp (and transformers) add BOS to a SentencePiece vocabulary that does not say otherwise
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", model == "llama")) and ids["bos"] is not None,
        sentencepiece=sp,
    )


def _load_gguf(path: Path, progress: bool, dtype: torch.dtype) -> LoadedModel:
    from gguf import GGUFReader, dequantize

    check_architecture(path)  # before the reader parses the whole vocabulary
    reader = GGUFReader(str(path))
    cfg = _gguf_config(reader)
    tokenizer = _gguf_tokenizer(reader, cfg.arch)  # refused here, before the weights are dequantized
    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantizing {path.name}", disable=not progress):
        arr = dequantize(t.data, t.tensor_type)
        arr = arr.reshape([int(x) for x in reversed(t.shape)])
        name = t.name
        if name == "token_embd.weight":
            hf = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            hf = "model.norm.weight"
        elif name == "output.weight":
            hf = "lm_head.weight"
        elif name == "rope_freqs.weight":
            hf = "rope_freqs"  # Llama 3 RoPE scaling as per-frequency divisors
        elif name in ("rope_factors_short.weight", "rope_factors_long.weight"):
            continue  # Phi-3's longrope factors: read into the config
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            names = _GGUF_SANDWICH_NAMES if cfg.sandwich_norms else _GGUF_PHI3_NAMES if cfg.arch == "phi3" else _GGUF_NAMES
            if kind not in names:
                raise ValueError(f"unexpected GGUF tensor {name}")
            hf = f"model.layers.{layer}.{names[kind]}.{suffix}"
            if cfg.arch == "llama" and kind in ("attn_q", "attn_k"):
                arr = _reverse_permute(arr, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        # an own copy (a float32 tensor's data is a view of the file), in the serving dtype at once
        weights[hf] = torch.tensor(arr, dtype=torch.float32 if hf in _FLOAT32_TENSORS else dtype)
    unfuse(weights, cfg)
    name = str(_field(reader, "general.name", path.stem))
    return LoadedModel(name, cfg, weights, tokenizer)
