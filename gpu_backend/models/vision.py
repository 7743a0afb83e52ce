"""The vision side of a LLaVA-style model in plain torch: a CLIP ViT tower and the projector into the
text model's embedding space (`VisionTower`), built from the checkpoint's weights.

How an image becomes embeddings (`VisionTower.encode`, as transformers' `LlavaModel.get_image_features`):
patches cut by a stride-`patch_size` convolution (no bias), the class embedding put in front, position
embeddings added, the pre-layernorm (CLIP's `pre_layrnorm`); then encoder layers, each
`x + attn(ln1(x))` then `x + fc2(act(fc1(ln2(x))))` (q/k/v fused into one matmul, SDPA without a mask);
the hidden states named by `VisionConfig.feature_layers` (0 = the embeddings, i = layer i's output;
LLaVA-1.5: -2, so the last layer is not run at all), CLS dropped unless `feature_select` is "full";
then `linear_2(act(linear_1(x)))`. CLIP's post-layernorm is not used by LLaVA and not loaded.

Weight names: `vision_weight_name` maps every layout transformers has written (`vision_tower.` /
`model.vision_tower.`, with or without CLIP's `vision_model.`, `multi_modal_projector.` /
`model.multi_modal_projector.`) to one, `vision_tower.<CLIP name>` and `multi_modal_projector.<name>`.
Another tower (SigLIP, ...) would be a second class here plus its row in `hf_dir.VISION_MODEL_TYPES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from gpu_backend.models.config import VisionConfig

__all__ = ["VISION_ACTIVATIONS", "VisionTower", "vision_weight_name"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN names of the activations a tower or projector may use
VISION_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": _quick_gelu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}

# checkpoint prefix -> ours (longest first: the first that matches wins)
_PREFIXES = (
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("multi_modal_projector.", "multi_modal_projector."),
)


def vision_weight_name(name: str) -> str | None:
    """`name` as `VisionTower` reads it, or None for a weight that is not the tower's or the projector's."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return None


@dataclass
class _Layer:
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv: torch.Tensor  # [3 * hidden, hidden]: q | k | v
    qkv_b: torch.Tensor
    out: torch.Tensor
    out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc1: torch.Tensor
    fc1_b: torch.Tensor
    fc2: torch.Tensor
    fc2_b: torch.Tensor


class VisionTower:
    """CLIP ViT + LLaVA projector (see the module docstring); `encode` turns pixel values into the
    embeddings that replace an image's placeholder tokens."""

    def __init__(self, cfg: VisionConfig, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        """Build from `weights` under any of the checkpoint layouts (`vision_weight_name`); the tower's
        and projector's tensors are taken out of the dict (others are left there), moved to `device`
        in `dtype`. Weights of layers past the deepest selected feature layer are dropped."""
        for k in [k for k in weights if vision_weight_name(k) not in (None, k)]:
            weights[str(vision_weight_name(k))] = weights.pop(k)
        if cfg.activation not in VISION_ACTIVATIONS or cfg.projector_activation not in VISION_ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {cfg.activation!r} / projector activation "
                             f"{cfg.projector_activation!r}: supported are {sorted(VISION_ACTIVATIONS)}")
        self.cfg = cfg
        self.device, self.dtype = device, dtype
        self.act = VISION_ACTIVATIONS[cfg.activation]
        self.proj_act = VISION_ACTIVATIONS[cfg.projector_activation]

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise KeyError(f"weight {name} missing from the checkpoint (vision tower / projector)")
            return weights.pop(name).to(device=device, dtype=dtype).contiguous()

        v, hid = "vision_tower.", cfg.hidden_size
        self.patch = w(v + "embeddings.patch_embedding.weight")  # [hidden, channels, patch, patch]
        self.cls = w(v + "embeddings.class_embedding")
        self.pos = w(v + "embeddings.position_embedding.weight")  # [patches + 1, hidden]
        if tuple(self.patch.shape) != (hid, cfg.num_channels, cfg.patch_size, cfg.patch_size) or \
                self.pos.shape[0] != cfg.num_patches + 1:
            raise ValueError(f"vision tower weights do not fit its config: patch embedding {tuple(self.patch.shape)}, "
                             f"{self.pos.shape[0]} positions for {cfg.num_patches} patches of {cfg.patch_size}")
        self.pre_w, self.pre_b = w(v + "pre_layrnorm.weight"), w(v + "pre_layrnorm.bias")
        self.layers: list[_Layer] = []
        for i in range(cfg.layers_run):
            p = f"{v}encoder.layers.{i}."
            a = p + "self_attn."
            self.layers.append(_Layer(
                ln1_w=w(p + "layer_norm1.weight"), ln1_b=w(p + "layer_norm1.bias"),
                qkv=torch.cat([w(a + f"{x}_proj.weight") for x in "qkv"]),
                qkv_b=torch.cat([w(a + f"{x}_proj.bias") for x in "qkv"]),
                out=w(a + "out_proj.weight"), out_b=w(a + "out_proj.bias"),
                ln2_w=w(p + "layer_norm2.weight"), ln2_b=w(p + "layer_norm2.bias"),
                fc1=w(p + "mlp.fc1.weight"), fc1_b=w(p + "mlp.fc1.bias"),
                fc2=w(p + "mlp.fc2.weight"), fc2_b=w(p + "mlp.fc2.bias"),
            ))
        for k in [k for k in weights if k.startswith(v)]:  # unused: the post-layernorm, layers past the features
            del weights[k]
        m = "multi_modal_projector."
        self.l1 = w(m + "linear_1.weight")
        self.l2 = w(m + "linear_2.weight")
        self.l1_b = w(m + "linear_1.bias") if cfg.projector_bias else None
        self.l2_b = w(m + "linear_2.bias") if cfg.projector_bias else None
        want = (cfg.text_hidden, hid * len(cfg.feature_layers))
        if tuple(self.l1.shape) != want:
            raise ValueError(f"projector linear_1 is {tuple(self.l1.shape)}, expected {want} (text hidden size, "
                             "vision hidden size x feature layers)")

    @property
    def image_tokens(self) -> int:
        """Embeddings per image (`encode`'s second dimension)."""
        return self.cfg.image_tokens

    def weight_bytes(self) -> int:
        tensors = [self.patch, self.cls, self.pos, self.pre_w, self.pre_b, self.l1, self.l2]
        tensors += [t for t in (self.l1_b, self.l2_b) if t is not None]
        tensors += [t for lw in self.layers for t in lw.__dict__.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def _layer(self, x: torch.Tensor, lw: _Layer) -> torch.Tensor:
        cfg = self.cfg
        b, n, hid = x.shape
        heads = cfg.num_heads
        y = F.layer_norm(x, (hid,), lw.ln1_w, lw.ln1_b, cfg.layer_norm_eps)
        qkv = F.linear(y, lw.qkv, lw.qkv_b).view(b, n, 3, heads, hid // heads).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # [b, heads, n, d]; scale d ** -0.5 as CLIP
        x = x + F.linear(o.transpose(1, 2).reshape(b, n, hid), lw.out, lw.out_b)
        y = F.layer_norm(x, (hid,), lw.ln2_w, lw.ln2_b, cfg.layer_norm_eps)
        return x + F.linear(self.act(F.linear(y, lw.fc1, lw.fc1_b)), lw.fc2, lw.fc2_b)

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Pixel values [B, channels, image_size, image_size] (as `image_preprocess.preprocess_image`
        makes them) -> image embeddings [B, image_tokens, text hidden] in the backend's dtype."""
        cfg = self.cfg
        want = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != want:
            raise ValueError(f"pixel values must be [batch, {', '.join(map(str, want))}], "
                             f"got {tuple(pixel_values.shape)}")
        x = pixel_values.to(device=self.device, dtype=self.dtype)
        x = F.conv2d(x, self.patch, stride=cfg.patch_size).flatten(2).transpose(1, 2)  # [B, patches, hidden]
        x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], dim=1) + self.pos
        x = F.layer_norm(x, (cfg.hidden_size,), self.pre_w, self.pre_b, cfg.layer_norm_eps)
        n = cfg.num_layers + 1
        wanted = {i % n for i in cfg.feature_layers}
        states = {0: x} if 0 in wanted else {}
        for i, lw in enumerate(self.layers, start=1):
            x = self._layer(x, lw)
            if i in wanted:
                states[i] = x
        first = 1 if cfg.feature_select == "default" else 0
        feats = torch.cat([states[i % n][:, first:] for i in cfg.feature_layers], dim=-1)
        return F.linear(self.proj_act(F.linear(feats, self.l1, self.l1_b)), self.l2, self.l2_b)
