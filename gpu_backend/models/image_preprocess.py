"""Image bytes -> a vision tower's pixel values, with Pillow and numpy, as transformers' CLIP image
processor (the one `LlavaProcessor` uses) computes them.

`preprocess_image(data, processing, media_type)`:
1. decode (`decode_image`): PNG, JPEG, WebP or GIF (its first frame), nothing else; the EXIF orientation
   applied as transformers' `load_image` applies it; an image over `MAX_PIXELS` is refused from its
   header, before its pixels are decoded (a decompression bomb costs nothing);
2. to RGB, transparency composited onto white (transformers' `convert_to_rgb`);
3. resize with Pillow (bicubic for CLIP): the shortest edge to `shortest_edge`, the other
   `int(shortest_edge * long / short)` (truncated, as transformers), or to an exact (h, w);
4. center crop (top = (h - crop_h) // 2, left likewise; zero-padded where the image is smaller);
5. rescale (x 1/255, in float64, then float32) and normalize ((x - mean) / std in float32);
channels first, float32 [3, H, W].

Each step is the one transformers' PIL backend (`CLIPImageProcessorPil`, which `CLIPImageProcessor`
is when torchvision is not installed) runs, so the values are equal to its (tests/test_backend_vision.py).
With torchvision installed, transformers' default `CLIPImageProcessor` resizes with torchvision's
antialiased bicubic on tensors instead: its pixels differ from Pillow's by a few 1/255 steps at edges.
The settings come from the checkpoint's preprocessor_config.json (`ImageProcessing`, read by
`gpu_backend/loading/hf_dir.py`); change a step here and its field there.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from gpu_backend.models.config import ImageProcessing

__all__ = ["FORMATS", "MAX_PIXELS", "MEDIA_TYPES", "ImageError", "decode_image", "preprocess_image", "to_pixels"]

MAX_PIXELS = 50_000_000  # width x height past which an image is refused (decompression bombs)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names of the formats decoded
MEDIA_TYPES = ("image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif")
_ACCEPTED = "PNG, JPEG, WebP or GIF (first frame)"


class ImageError(ValueError):
    """Image bytes that cannot be used: not a decodable PNG / JPEG / WebP / GIF, or too large."""


def decode_image(data: bytes, media_type: str | None = None, max_pixels: int = MAX_PIXELS) -> Image.Image:
    """The RGB image (transparency on white, EXIF orientation applied) in `data`.

    media_type: the type the caller was given (e.g. from a data URL); must be one of `MEDIA_TYPES`
    when set, but the format is read from the bytes themselves (a mislabelled PNG still decodes)."""
    if media_type and media_type.split(";")[0].strip().lower() not in MEDIA_TYPES:
        raise ImageError(f"unsupported image media type {media_type!r}: accepted are {', '.join(MEDIA_TYPES)}")
    if not data:
        raise ImageError(f"empty image: expected {_ACCEPTED} bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            src = Image.open(io.BytesIO(data), formats=list(FORMATS))  # reads the header only
            w, h = src.size
            if w * h > max_pixels:
                raise ImageError(f"image is {w}x{h} = {w * h} pixels: more than the {max_pixels} accepted")
            if w < 1 or h < 1:
                raise ImageError(f"image is {w}x{h}: empty")
            src.seek(0)  # an animation's first frame
            src.load()
            img = ImageOps.exif_transpose(src)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"image too large, more than the {max_pixels} pixels accepted (Pillow: {e})") from None
    except (UnidentifiedImageError, OSError, ValueError, EOFError, SyntaxError) as e:
        raise ImageError(f"cannot decode the image ({type(e).__name__}: {e}): expected {_ACCEPTED}") from None
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return img.convert("RGB")


def _resized_size(h: int, w: int, p: ImageProcessing) -> tuple[int, int]:
    """(h, w) after the resize step (transformers' `get_resize_output_image_size`, default_to_square=False)."""
    if p.shortest_edge is not None:
        short, long = (w, h) if w <= h else (h, w)
        new_long = int(p.shortest_edge * long / short)
        return (new_long, p.shortest_edge) if w <= h else (p.shortest_edge, new_long)
    assert p.size is not None
    return p.size


def _center_crop(a: np.ndarray, ch: int, cw: int) -> np.ndarray:
    """Center crop of an [H, W, C] array, zero-padded (centered) where it is smaller than (ch, cw)."""
    h, w = a.shape[:2]
    if h < ch or w < cw:
        nh, nw = max(h, ch), max(w, cw)
        padded = np.zeros((nh, nw, a.shape[2]), dtype=a.dtype)
        top, left = -(-(nh - h) // 2), -(-(nw - w) // 2)  # ceil, as transformers pads
        padded[top:top + h, left:left + w] = a
        a, h, w = padded, nh, nw
    top, left = (h - ch) // 2, (w - cw) // 2
    return a[top:top + ch, left:left + cw]


def to_pixels(img: Image.Image, p: ImageProcessing) -> np.ndarray:
    """Steps 3-5 on a decoded RGB image: float32 [3, H, W]."""
    if p.shortest_edge is not None or p.size is not None:
        h, w = _resized_size(img.height, img.width, p)
        img = img.resize((w, h), resample=Image.Resampling(p.resample))  # (a copy when the size is the same)
    a = np.asarray(img)
    if p.crop is not None:
        a = _center_crop(a, *p.crop)
    x = a.astype(np.float64) * p.rescale if p.rescale is not None else a
    x = x.astype(np.float32)
    if p.mean is not None and p.std is not None:
        x = (x - np.asarray(p.mean, dtype=np.float32)) / np.asarray(p.std, dtype=np.float32)
    return np.ascontiguousarray(x.transpose(2, 0, 1), dtype=np.float32)


def preprocess_image(data: bytes, p: ImageProcessing, media_type: str | None = None,
                     max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """Image bytes -> float32 pixel values [3, H, W] (the module docstring's steps); ImageError if the
    bytes are not an accepted image."""
    return to_pixels(decode_image(data, media_type, max_pixels), p)
