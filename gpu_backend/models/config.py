"""Configuration dataclasses: the model architecture (with its per-layer spec) and the metadata the host sees.

A family's differences from Llama are data here, not branches in the forward: which norms a layer
has and how they scale, the MLP's activation, the embedding scale, attention's scale and
soft-capping, and each layer's sliding window and RoPE table (`ModelConfig.layer_specs`).
`hf_dir.py` and `gguf.py` fill them in from the checkpoint's config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class LayerSpec:
    """What differs between the layers of one model.

    window: keys a query sees, itself included (logical cache slots `(s - window, s]` for the query in
    slot s, as transformers' sliding-window mask), 0 = all earlier slots. rope: index of the layer's
    RoPE table in `ModelConfig.rope_tables()`.
    """

    window: int = 0
    rope: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama, Qwen2/3, Mistral, Gemma 2/3, Phi-3).

    The defaults are Llama's; the fields after `rope_scaling` describe the other families.
    """

    arch: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    rope_theta: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm: bool = False
    # RMSNorm multiplies by (norm_offset + weight): Gemma stores weight - 1 (offset 1.0)
    norm_offset: float = 0.0
    # norms on the attention and MLP outputs too, before the residual add (Gemma 2 / 3)
    sandwich_norms: bool = False
    # token embeddings are multiplied by this (Gemma: sqrt(hidden_size))
    embed_scale: float = 1.0
    # the MLP gate's activation: silu (Llama) or gelu_tanh (Gemma)
    activation: str = "silu"
    # softmax scale of attention; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_scale: float | None = None
    # cap * tanh(x / cap) on attention scores / final logits (Gemma 2); None = off
    attn_softcap: float | None = None
    final_softcap: float | None = None
    # sliding-window attention: window size (0 = none) and which layers slide (empty = every layer)
    sliding_window: int = 0
    sliding_layers: tuple[bool, ...] = ()
    # RoPE base of the sliding layers, unscaled (Gemma 3's rope_local_base_freq); None = rope_theta
    local_rope_theta: float | None = None
    # the embedding widths the model was trained to be cut to (Matryoshka representation: config.json's
    # `is_matryoshka` / `matryoshka_dimensions`, vLLM's names): None = none declared (an embedding is
    # its full width), () = any width, else those widths (`/v1/embeddings` `dimensions`)
    matryoshka: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {self.activation!r}: supported are {ACTIVATIONS}")
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise ValueError(f"sliding_layers has {len(self.sliding_layers)} entries for {self.num_layers} layers")
        if self.sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0, got {self.sliding_window}")

    def layer_specs(self) -> list[LayerSpec]:
        """Each layer's window and RoPE table."""
        slides = self.sliding_layers or (True,) * self.num_layers
        local_table = 1 if self.local_rope_theta is not None else 0
        return [LayerSpec(window=self.sliding_window, rope=local_table) if s and self.sliding_window
                else LayerSpec() for s in slides]

    def rope_tables(self) -> list[tuple[float, dict[str, Any] | None]]:
        """(theta, scaling) of each RoPE table: the model's, then the sliding layers' own if they have one."""
        tables: list[tuple[float, dict[str, Any] | None]] = [(self.rope_theta, self.rope_scaling)]
        if self.local_rope_theta is not None:
            tables.append((self.local_rope_theta, None))
        return tables

    @property
    def long_rope_from(self) -> int:
        """Longrope with long factors (Phi-3 128k): transformers rotates a pass's tokens with the long
        factors once the sequence is longer than `original_max_position_embeddings` (its last
        position in the pass reaches this), else with the short ones; 0 = one set of factors."""
        s = self.rope_scaling
        if s is None or s.get("rope_type", s.get("type")) not in ("longrope", "su") or not s.get("long_factor"):
            return 0
        orig = int(s["original_max_position_embeddings"])
        return orig if self.max_position > orig else 0

    @property
    def window(self) -> int:
        """The sliding window of the layers that have one (one size per model), 0 = no layer slides."""
        return max(s.window for s in self.layer_specs())

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if "sliding_layers" in d:  # a list after a JSON round trip
            d["sliding_layers"] = tuple(d["sliding_layers"])
        if d.get("matryoshka") is not None:
            d["matryoshka"] = tuple(d["matryoshka"])
        return cls(**d)


@dataclass(frozen=True)
class ModelInfo:
    """What the host needs to know about the loaded model and its KV cache."""

    name: str
    page_size: int
    num_pages: int
    vocab_size: int
    stop_tokens: list[int]
    chat_template: str
    bos_token_id: int | None
    eos_token_id: int | None
    device: str
    dtype: str
    max_position: int = 0
    hidden_size: int = 0  # the text model's: the width of an embedding run (`gpu_backend.images.embed_image`)
    # a vision-language model (VisionConfig): the placeholder token an image's embeddings replace, and
    # how many of them one image takes; None / 0 for a text-only model
    image_token_id: int | None = None
    image_tokens: int = 0
    # the widths an embedding may be cut to (`ModelConfig.matryoshka`; a list: it crosses the engine
    # wire): None = its full width only, [] = any width up to hidden_size
    matryoshka: list[int] | None = None


@dataclass(frozen=True)
class ImageProcessing:
    """How image bytes become a tower's pixel values, as transformers' CLIPImageProcessor does it
    (`gpu_backend/models/image_preprocess.py` runs it; `hf_dir.py` reads it from preprocessor_config.json).

    Steps in order: convert to RGB (transparency composited onto white), resize (the shortest edge to
    `shortest_edge` keeping the aspect ratio, or to `size` (h, w) exactly; PIL filter `resample`, 3 =
    bicubic), center crop to `crop` (h, w), multiply by `rescale`, normalize with `mean` / `std` per
    channel. A step whose field is None is skipped.
    """

    shortest_edge: int | None = 224
    size: tuple[int, int] | None = None
    crop: tuple[int, int] | None = (224, 224)
    resample: int = 3
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = (0.48145466, 0.4578275, 0.40821073)
    std: tuple[float, ...] | None = (0.26862954, 0.26130258, 0.27577711)

    def out_size(self) -> tuple[int, int] | None:
        """(h, w) of every processed image, when it is fixed (a crop or an exact resize)."""
        return self.crop or self.size


VISION_FEATURE_SELECT = ("default", "full")


@dataclass(frozen=True)
class VisionConfig:
    """A LLaVA-style vision side (`gpu_backend/models/vision.py`): a CLIP ViT tower, the hidden states
    it hands on, and the projector into the text model's embedding space.

    feature_layers: indices into the tower's hidden states (0 = the embeddings after the pre-layernorm,
    i = the output of layer i, negatives count from the end: LLaVA-1.5 takes -2); more than one are
    concatenated on the feature axis. feature_select: "default" drops the CLS position, "full" keeps it.
    """

    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    text_hidden: int
    image_token_id: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    activation: str = "quick_gelu"
    feature_layers: tuple[int, ...] = (-2,)
    feature_select: str = "default"
    projector_activation: str = "gelu"
    projector_bias: bool = True
    processing: ImageProcessing = field(default_factory=ImageProcessing)

    def __post_init__(self) -> None:
        if self.feature_select not in VISION_FEATURE_SELECT:
            raise ValueError(f"unsupported vision_feature_select_strategy {self.feature_select!r}: "
                             f"supported are {VISION_FEATURE_SELECT}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size {self.patch_size}")
        if not self.feature_layers:
            raise ValueError("vision_feature_layer is empty")
        for i in self.feature_layers:
            if not -(self.num_layers + 1) <= i <= self.num_layers:
                raise ValueError(f"vision_feature_layer {i} is outside the tower's {self.num_layers + 1} hidden states")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def image_tokens(self) -> int:
        """Embeddings (placeholder tokens) per image: one per patch, plus CLS when it is kept."""
        return self.num_patches + (1 if self.feature_select == "full" else 0)

    @property
    def layers_run(self) -> int:
        """Encoder layers the features need (the layers past the deepest selected one are skipped)."""
        n = self.num_layers + 1
        return max(i % n for i in self.feature_layers)
