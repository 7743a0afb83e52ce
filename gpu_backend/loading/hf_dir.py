"""Read a Hugging Face model directory: config.json, tokenizer.json and *.safetensors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from gpu_backend.loading.model_files import GPT2_PATTERN, SMOLLM_PATTERN, LoadedModel, TokenizerSpec
from gpu_backend.models.config import ModelConfig

__all__ = ["load_hf_dir"]


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


def load_hf_dir(path: Path, progress: bool) -> LoadedModel:
    """Load an HF safetensors directory (weights keep their dtype until the model is built)."""
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
