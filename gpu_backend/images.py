"""Images into a vision-language model: `embed_image` turns image bytes into the embeddings that
replace the image's placeholder tokens in a forward pass (`ForwardRequest.embeds`).

The bytes are decoded and preprocessed on the calling thread (Pillow + numpy,
`gpu_backend/models/image_preprocess.py`, outside the backend's lock), then the backend's vision tower
(`TorchBackend.vision`, a `gpu_backend.models.vision.VisionTower` that build.py sets for a LLaVA
checkpoint) runs under the backend's lock, as a forward pass does, so it never overlaps one.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from gpu_backend.models.image_preprocess import ImageError, preprocess_image

__all__ = ["ImageError", "embed_image"]


def embed_image(backend: Any, data: bytes, media_type: str) -> np.ndarray:
    """The embeddings of one image: float32 [info.image_tokens, info.hidden_size], in the order of
    the placeholder tokens they replace (their bytes are a `ForwardRequest.embeds` run).

    backend: a `TorchBackend` (anything with `vision`, `_lock` and the tower's device). ImageError
    (a ValueError) for bytes that are not an accepted image (PNG, JPEG, WebP, GIF; at most
    `image_preprocess.MAX_PIXELS` pixels) or an unaccepted media type; ValueError for a text-only model."""
    tower = getattr(backend, "vision", None)
    if tower is None:
        name = getattr(getattr(backend, "info", None), "name", "the model")
        raise ValueError(f"this model has no vision tower ({name} is text-only): images need a LLaVA checkpoint")
    pixels = torch.from_numpy(preprocess_image(data, tower.cfg.processing, media_type))[None]
    with backend._lock, torch.inference_mode():
        out = tower.encode(pixels)[0].float().cpu().numpy()
    return np.ascontiguousarray(out, dtype=np.float32)
