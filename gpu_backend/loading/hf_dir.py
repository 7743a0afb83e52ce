"""Read a Hugging Face model directory: config.json (`FAMILIES`: what each model_type adds to Llama),
*.safetensors (fused tensors split; of a multimodal checkpoint the text model, plus a LLaVA's vision
tower and projector: `VISION`), preprocessor_config.json (a LLaVA's image processing), and its
tokenizer (`hf_tokenizer.py`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from gpu_backend.loading.hf_tokenizer import SUPPORTED_TOKENIZERS, hf_tokenizer
from gpu_backend.loading.hf_tokenizer import (
    hf_tokenizer as _hf_tokenizer,  # the name bench/gpu_suite.py imports
)
from gpu_backend.loading.model_files import LoadedModel
from gpu_backend.models.config import ImageProcessing, ModelConfig, VisionConfig
from gpu_backend.models.vision import VISION_ACTIVATIONS, vision_weight_name

__all__ = ["FAMILIES", "MULTIMODAL", "SUPPORTED_MODEL_TYPES", "SUPPORTED_TOKENIZERS", "VISION", "_hf_tokenizer",
           "load_hf_dir", "unfuse"]


# What each supported `model_type` adds to Llama's architecture (the rest is read from config.json).
_GEMMA: dict[str, Any] = {"norm_offset": 1.0, "sandwich_norms": True}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "phi3": {},
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA | {"qk_norm": True},
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling of the global layers, theta of the sliding layers or None), from either layout:
    `rope_theta` / `rope_scaling` / `rope_local_base_freq` (config files) or `rope_parameters`
    (transformers 5; per layer type for Gemma 3)."""
    params = cfg.get("rope_parameters")
    local_theta = cfg.get("rope_local_base_freq")
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope scaling {local.get('rope_type')!r} on the sliding layers")
        local_theta = local.get("rope_theta", local_theta)
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if theta is None and isinstance(params, dict):
        scaling = params
        theta = params.get("rope_theta")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    if scaling is not None and float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"unsupported partial_rotary_factor {scaling['partial_rotary_factor']}: RoPE over the "
                         "whole head only")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su"):
        scaling = dict(scaling)
        orig = int(scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        scaling["original_max_position_embeddings"] = orig
        if scaling.get("factor") is None:
            scaling["factor"] = int(cfg.get("max_position_embeddings", orig)) / orig
    return float(theta or 10000.0), scaling, None if local_theta is None else float(local_theta)


def _sliding_layers(cfg: dict[str, Any], mt: str, n: int) -> tuple[int, tuple[bool, ...]]:
    """(window, which layers slide) as transformers decides them; (0, ()) = no sliding window."""
    window = cfg.get("sliding_window")
    types = cfg.get("layer_types")
    if types is not None:
        slides = tuple(t == "sliding_attention" for t in types)
        if any(t not in ("sliding_attention", "full_attention") for t in types):
            raise ValueError(f"unsupported layer_types {sorted(set(types))}: sliding_attention and full_attention")
    elif mt in ("qwen2", "qwen3"):
        first = int(cfg.get("max_window_layers", n))
        slides = tuple(bool(cfg.get("use_sliding_window")) and i >= first for i in range(n))
    elif mt == "gemma2":
        slides = tuple(i % 2 == 0 for i in range(n))
    elif mt == "gemma3_text":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        slides = tuple((i + 1) % pattern != 0 for i in range(n))
    else:
        slides = (True,) * n
    if not any(slides) or window is None:
        return 0, ()
    return int(window), slides


# Multimodal checkpoints whose text model we run: model_type -> (the text config's key, weight-name
# prefixes of the text model -> HF text names). Other weights are not read, except a VISION model's
# tower and projector. (transformers 5.24 saves a LLaVA under the older names, `language_model.model.`,
# `language_model.lm_head.`, `vision_tower.`, `multi_modal_projector.`; it loads both.)
_TEXT_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                  "language_model.lm_head.": "lm_head.", "lm_head.": "lm_head."}
MULTIMODAL: dict[str, tuple[str, dict[str, str]]] = {
    "gemma3": ("text_config", _TEXT_PREFIXES),
    "llava": ("text_config", _TEXT_PREFIXES),
}
# Vision-language checkpoints whose images we embed too (gpu_backend/models/vision.py): model_type ->
# the vision config's model_type when it has none, and the ones supported.
VISION: dict[str, tuple[str, tuple[str, ...]]] = {
    "llava": ("clip_vision_model", ("clip_vision_model",)),
}
# the text config's model_type when it has none (transformers' LlavaConfig: llama)
_TEXT_MODEL_TYPE = {"gemma3": "gemma3_text", "llava": "llama"}
# what transformers' config classes default to, for text configs that leave them out (llava-1.5's
# config.json lists only what differs from LlamaConfig); tests/test_backend_vision.py checks them
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6),
    "mistral": dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                    rms_norm_eps=1e-6, sliding_window=4096),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6),
}
# CLIPVisionConfig's defaults, and LlavaConfig's vision config when it has none (CLIP ViT-L/14 at 336)
_CLIP_DEFAULTS: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                                      hidden_act="quick_gelu", layer_norm_eps=1e-5)
_LLAVA_VISION: dict[str, Any] = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                     num_attention_heads=16, image_size=336, patch_size=14)


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (MULTIMODAL), else `cfg` itself."""
    mt = cfg.get("model_type")
    if mt not in MULTIMODAL:
        return cfg
    text = dict(cfg.get(MULTIMODAL[mt][0]) or {})
    text.setdefault("model_type", _TEXT_MODEL_TYPE.get(str(mt), f"{mt}_text"))
    if mt in VISION:
        text = _TEXT_DEFAULTS.get(text["model_type"], {}) | text
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def _size(v: Any, what: str) -> tuple[int, int]:
    """(h, w) of a preprocessor size: {"height", "width"}, an int, or [h, w]."""
    if isinstance(v, dict) and "height" in v and "width" in v:
        return int(v["height"]), int(v["width"])
    if isinstance(v, int):
        return v, v
    if isinstance(v, list | tuple) and len(v) == 2:
        return int(v[0]), int(v[1])
    raise ValueError(f"preprocessor_config.json: unsupported {what} {v!r}: height and width, or one int")


def _image_processing(path: Path, image_size: int) -> ImageProcessing:
    """The image processing of a vision checkpoint: preprocessor_config.json's fields (CLIPImageProcessor
    and its defaults), or without the file CLIP's at the tower's image size."""
    f = path / "preprocessor_config.json"
    if not f.exists():
        return ImageProcessing(shortest_edge=image_size, crop=(image_size, image_size))
    pc = json.loads(f.read_text())
    if pc.get("do_pad") or pc.get("image_grid_pinpoints"):
        raise ValueError(f"{f}: padding and image grids (LLaVA-NeXT) are not supported: CLIP-style resize and "
                         "center crop only")
    shortest, size = None, None
    if pc.get("do_resize", True):
        raw = pc.get("size", {"shortest_edge": image_size})
        if isinstance(raw, dict) and "shortest_edge" in raw:
            shortest = int(raw["shortest_edge"])
        else:
            size = _size(raw, "size")
    crop = _size(pc.get("crop_size", image_size), "crop_size") if pc.get("do_center_crop", True) else None
    d = ImageProcessing()
    return ImageProcessing(
        shortest_edge=shortest, size=size, crop=crop, resample=int(pc.get("resample", d.resample)),
        rescale=float(pc.get("rescale_factor", 1 / 255)) if pc.get("do_rescale", True) else None,
        mean=tuple(float(x) for x in pc.get("image_mean", d.mean)) if pc.get("do_normalize", True) else None,
        std=tuple(float(x) for x in pc.get("image_std", d.std)) if pc.get("do_normalize", True) else None,
    )


def _vision_config(raw: dict[str, Any], path: Path, text_hidden: int) -> VisionConfig | None:
    """The vision side of a VISION checkpoint (None for any other), refused here if unsupported."""
    mt = raw.get("model_type")
    if mt not in VISION:
        return None
    default_type, supported = VISION[str(mt)]
    given = raw.get("vision_config")
    vc = _CLIP_DEFAULTS | (_LLAVA_VISION if given is None else {}) | dict(given or {})
    vt = vc.get("model_type", default_type)
    if vt not in supported:
        raise ValueError(f"unsupported vision tower {vt!r} in a {mt} checkpoint: supported are {', '.join(supported)}")
    layer = raw.get("vision_feature_layer", -2)
    act = str(vc["hidden_act"])
    proj_act = str(raw.get("projector_hidden_act", "gelu"))
    for a in (act, proj_act):
        if a not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {a!r}: supported are {sorted(VISION_ACTIVATIONS)}")
    token = raw.get("image_token_index", raw.get("image_token_id", 32000))
    image_size = int(vc["image_size"])
    proc = _image_processing(path, image_size)
    if proc.out_size() != (image_size, image_size):
        raise ValueError(f"{path}/preprocessor_config.json makes {proc.out_size()} images: the tower takes "
                         f"{image_size}x{image_size}")
    return VisionConfig(
        image_size=image_size, patch_size=int(vc["patch_size"]), hidden_size=int(vc["hidden_size"]),
        intermediate_size=int(vc["intermediate_size"]), num_layers=int(vc["num_hidden_layers"]),
        num_heads=int(vc["num_attention_heads"]), text_hidden=text_hidden, image_token_id=int(token),
        num_channels=int(vc["num_channels"]), layer_norm_eps=float(vc["layer_norm_eps"]), activation=act,
        feature_layers=tuple(int(i) for i in layer) if isinstance(layer, list) else (int(layer),),
        feature_select=str(raw.get("vision_feature_select_strategy", "default")),
        projector_activation=proj_act, projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        processing=proc,
    )


def _hf_config(cfg: dict[str, Any]) -> ModelConfig:
    cfg = _text_config(cfg)
    mt = cfg.get("model_type", "llama")
    if mt not in FAMILIES:
        raise ValueError(f"unsupported model_type {mt!r}: supported are "
                         f"{', '.join(SUPPORTED_MODEL_TYPES + tuple(MULTIMODAL))} (multimodal: the text model)")
    fam = FAMILIES[mt]
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    n = int(cfg["num_hidden_layers"])
    theta, scaling, local_theta = _rope(cfg)
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported activation {act!r}: supported are {sorted(_ACTIVATIONS)}")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    if scaling is not None and "original_max_position_embeddings" in scaling and scaling.get(
            "rope_type", scaling.get("type")) in ("longrope", "su") and not scaling.get("long_factor"):
        # short factors only: the context stops where transformers would switch to long ones
        max_pos = min(max_pos, int(scaling["original_max_position_embeddings"]))
    window, slides = _sliding_layers(cfg, mt, n)
    qpas = cfg.get("query_pre_attn_scalar")
    gemma = fam.get("sandwich_norms", False)
    return ModelConfig(
        arch=mt,
        num_layers=n,
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(cfg["vocab_size"]),
        rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position=max_pos,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
        qkv_bias=bool(cfg.get("attention_bias", fam.get("qkv_bias", False))),
        rope_scaling=scaling,
        qk_norm=fam.get("qk_norm", False),
        norm_offset=fam.get("norm_offset", 0.0),
        sandwich_norms=gemma,
        embed_scale=hidden**0.5 if gemma else 1.0,
        activation=_ACTIVATIONS[act],
        attn_scale=None if qpas is None else float(qpas) ** -0.5,
        attn_softcap=None if cfg.get("attn_logit_softcapping") is None else float(cfg["attn_logit_softcapping"]),
        final_softcap=None if cfg.get("final_logit_softcapping") is None else float(cfg["final_logit_softcapping"]),
        sliding_window=window,
        sliding_layers=slides,
        local_rope_theta=local_theta if any(slides) else None,
        matryoshka=_matryoshka(cfg, hidden),
    )


def _matryoshka(cfg: dict[str, Any], hidden: int) -> tuple[int, ...] | None:
    """The widths config.json says an embedding may be cut to (`matryoshka_dimensions`, or any with
    `is_matryoshka`), as vLLM reads them; None when it says neither."""
    dims = cfg.get("matryoshka_dimensions")
    if dims is not None:
        if not isinstance(dims, list) or not all(isinstance(d, int) and 0 < d <= hidden for d in dims):
            raise ValueError(f"matryoshka_dimensions must be a list of widths in [1, {hidden}], got {dims!r}")
        return tuple(sorted(set(dims)))
    return () if cfg.get("is_matryoshka") else None


def unfuse(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Split checkpoints' fused projections (Phi-3's qkv_proj, gate_up_proj) into the HF names the
    model reads, in place (views, no copy)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for name in [k for k in weights if k.endswith((".qkv_proj.weight", ".qkv_proj.bias"))]:
        base, kind = name.rsplit(".qkv_proj.", 1)
        for part, t in zip("qkv", weights.pop(name).split([q, kv, kv]), strict=True):
            weights[f"{base}.{part}_proj.{kind}"] = t
    for name in [k for k in weights if k.endswith(".gate_up_proj.weight")]:
        base = name.removesuffix(".gate_up_proj.weight")
        gate, up = weights.pop(name).split(cfg.intermediate_size)
        weights[f"{base}.gate_proj.weight"], weights[f"{base}.up_proj.weight"] = gate, up


def load_hf_dir(path: Path, progress: bool, dtype: torch.dtype | None = None) -> LoadedModel:
    """Load an HF safetensors directory, each floating-point tensor cast to `dtype` as it is read
    (None: the checkpoint's dtype, cast when the model is built)."""
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} is not an HF model directory: config.json missing")
    raw = json.loads(cfg_file.read_text())
    cfg = _hf_config(raw)
    vision = _vision_config(raw, path, cfg.hidden_size)
    if vision is not None and not 0 <= vision.image_token_id < cfg.vocab_size:
        raise ValueError(f"{path}: image token {vision.image_token_id} is outside the vocabulary ({cfg.vocab_size})")
    tokenizer = hf_tokenizer(path, raw)  # refused here, before the weights are read, if unsupported
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    rename = MULTIMODAL[raw["model_type"]][1] if raw.get("model_type") in MULTIMODAL else None
    weights: dict[str, torch.Tensor] = {}
    vision_weights: dict[str, torch.Tensor] = {}
    for f in tqdm(files, desc=f"loading {path.name}", disable=not progress):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = k if rename is None else _renamed(k, rename)
                into = weights
                if name is None and vision is not None:
                    name, into = vision_weight_name(k), vision_weights
                if name is not None:
                    t = st.get_tensor(k)
                    into[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    cfg = headless(weights, cfg)
    unfuse(weights, cfg)
    return LoadedModel(path.name, cfg, weights, tokenizer, vision, vision_weights)


def headless(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> ModelConfig:
    """A checkpoint saved from the base model (transformers' `Qwen3Model`, as Qwen3-Embedding ships:
    `embed_tokens.weight`, `layers.N.*`, `norm.weight`, no LM head, untied in the 8B's config): its
    names under `model.` in place, and the head tied to the embedding table (its logits are then the
    table's; such a model is for its hidden states). Other checkpoints are returned as they are."""
    if "model.embed_tokens.weight" not in weights and "embed_tokens.weight" in weights:
        for k in [k for k in weights if not k.startswith(("model.", "lm_head."))]:
            weights["model." + k] = weights.pop(k)
    if not cfg.tie_embeddings and "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        return dataclasses.replace(cfg, tie_embeddings=True)
    return cfg


def _renamed(name: str, prefixes: dict[str, str]) -> str | None:
    """`name` under the text model's HF names, or None for a weight of another part of the model."""
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old):]
    return None
