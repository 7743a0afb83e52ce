"""A LLaVA-style vision-language model end to end against transformers, on tiny random-weight
`LlavaForConditionalGeneration` checkpoints built here (CLIP ViT tower + Llama text model, saved with
`save_pretrained`): the image features of our `VisionTower`, our Pillow preprocessing against
transformers' CLIP image processor, the refusals (`ImageError`), a text-only model, and the whole
model's logits and greedy tokens with the image's embeddings in the prompt (`ForwardRequest.embeds`)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from backend_checks import req
from PIL import Image

from gpu_backend import load_backend
from gpu_backend.images import embed_image
from gpu_backend.loading.hf_dir import _CLIP_DEFAULTS, _LLAVA_VISION, _TEXT_DEFAULTS
from gpu_backend.loading.loader import load_model_files
from gpu_backend.models.config import ImageProcessing
from gpu_backend.models.image_preprocess import MAX_PIXELS, ImageError, decode_image, preprocess_image
from gpu_backend.models.vision import VisionTower, vision_weight_name

transformers = pytest.importorskip("transformers")

IMAGE_TOKEN = 258  # "<image>" in the byte-level tokenizer below (bytes 0-255, then <s>, </s>, <image>)
VOCAB = 300
# float32 on both sides, same weights; only summation order differs (fused q|k|v, SDPA): features
# and logits of ~0.1-1 agree to ~1e-6. 1e-4 is ~100x that, and any real defect (a wrong layer, the CLS
# kept, a wrong activation or a misplaced embedding) moves them by 1e-2 or more.
TOL = 1e-4


def tiny_tokenizer(out: Path) -> None:
    """A byte-level BPE tokenizer.json over the 256 bytes (id = byte, no merges) plus <s>, </s>, <image>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>", "<image>"])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


VARIANTS = {
    # LLaVA-1.5's choices: the second-to-last layer's hidden states, CLS dropped, projector biases
    "llava15": dict(vision_feature_layer=-2, vision_feature_select_strategy="default"),
    # the others: several layers concatenated (the embeddings among them), CLS kept, no projector
    # biases, another tower activation
    "full": dict(vision_feature_layer=[0, -1], vision_feature_select_strategy="full",
                 multimodal_projector_bias=False, projector_hidden_act="gelu_pytorch_tanh"),
}


def make_llava(out: Path, variant: str, processor: dict | None = None):
    """A random-weight LlavaForConditionalGeneration saved to `out` (norms and biases made to matter)."""
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=32, patch_size=8, projection_dim=16,
                  hidden_act="quick_gelu" if variant == "llava15" else "gelu")
    text = dict(model_type="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=256,
                eos_token_id=257)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                                   **VARIANTS[variant])
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif "projector" in name:
                p.mul_(8.0)  # the init's projector outputs are tiny next to the token embeddings
    model.save_pretrained(out)
    tiny_tokenizer(out)
    if processor is not None:
        transformers.CLIPImageProcessorPil(**processor).save_pretrained(out)
    return model.float().eval()


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """(dir, transformers model) of the LLaVA-1.5-shaped variant, with a preprocessor_config.json that
    resizes to 36 then crops the tower's 32."""
    out = tmp_path_factory.mktemp("llava") / "llava15"
    model = make_llava(out, "llava15", processor=dict(size={"shortest_edge": 36}, crop_size=32))
    return out, model


def _backend(path: Path):
    return load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)


def _their_features(model, pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=pixels)
    return torch.stack(list(out.pooler_output))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_image_features_match_transformers(tmp_path, variant):
    model = make_llava(tmp_path / variant, variant)
    files = load_model_files(tmp_path / variant, progress=False)
    assert files.vision is not None and files.config.arch == "llama" and files.config.vocab_size == VOCAB
    assert not any("vision" in k or "projector" in k for k in files.weights)
    tower = VisionTower(files.vision, files.vision_weights, torch.device("cpu"), torch.float32)
    assert not files.vision_weights  # all taken (the unused post-layernorm / layers dropped)
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 32, 32)
    ours, theirs = tower.encode(pixels), _their_features(model, pixels)
    want_tokens = 16 + (variant == "full")
    assert ours.shape == theirs.shape == (2, want_tokens, 64) and tower.image_tokens == want_tokens
    diff = (ours - theirs).abs().max().item()
    assert diff < TOL, f"max |feature diff| {diff}"
    assert theirs.abs().max().item() > 0.1  # not vanishing: the bound above means something
    # a defect the tolerance must catch: the CLS position kept / dropped the other way
    assert (tower.encode(pixels[:1])[0, -16:] - theirs[0, -16:]).abs().max() < TOL
    if variant == "llava15":
        assert len(tower.layers) == 1  # -2 of 2 layers: the last one is not run


def test_tower_takes_every_checkpoint_layout(llava):
    # transformers 5.24 saves `vision_tower.`; the hub's llava-hf checkpoints have CLIP's
    # `vision_model.` inside it; transformers' in-memory names start with `model.`
    path, model = llava
    files = load_model_files(path, progress=False)
    assert files.vision is not None
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.startswith("model.vision_tower.") for k in sd)  # in memory: model.vision_tower.<CLIP>
    hub = {k.replace("model.vision_tower.", "vision_tower.vision_model.").replace("model.multi_modal_projector.",
                                                                                   "multi_modal_projector."): v
           for k, v in sd.items()}
    pixels = torch.randn(1, 3, 32, 32)
    want = _their_features(model, pixels)
    for weights in (sd, hub):
        tower = VisionTower(files.vision, dict(weights), torch.device("cpu"), torch.float32)
        assert (tower.encode(pixels) - want).abs().max().item() < TOL
    assert vision_weight_name("language_model.model.embed_tokens.weight") is None
    name = vision_weight_name("model.vision_tower.vision_model.pre_layrnorm.weight")
    assert name == "vision_tower.pre_layrnorm.weight"


def test_backend_exposes_the_vision_side(llava):
    path, _ = llava
    be = _backend(path)
    assert be.vision is not None
    assert (be.info.image_token_id, be.info.image_tokens, be.info.hidden_size) == (IMAGE_TOKEN, 16, 64)
    proc = be.vision.cfg.processing
    assert (proc.shortest_edge, proc.crop, proc.resample) == (36, (32, 32), 3)
    assert be.tokenizer.encode("<image>") == [IMAGE_TOKEN]


def test_bf16_tower_close_to_float32(llava):
    path, model = llava
    files = load_model_files(path, progress=False, dtype=torch.bfloat16)
    assert files.vision is not None
    tower = VisionTower(files.vision, files.vision_weights, torch.device("cpu"), torch.bfloat16)
    pixels = torch.randn(1, 3, 32, 32)
    got = tower.encode(pixels)
    assert got.dtype == torch.bfloat16
    want = _their_features(model, pixels)
    rel = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert rel < 0.05, rel  # bf16 keeps ~3 significant digits through 2 layers


# -- preprocessing ------------------------------------------------------------------------------


def _gradient(w: int, h: int, mode: str = "RGB") -> Image.Image:
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x * 7 + y * 13) % 256,
                  (x + y) * 255 // max(w + h - 2, 1)], axis=-1).astype(np.uint8)
    return Image.fromarray(a, "RGBA").convert(mode) if mode != "RGBA" else Image.fromarray(a, "RGBA")


def _encoded(img: Image.Image, fmt: str, **kw: object) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def _images() -> dict[str, tuple[bytes, str]]:
    rgba = _gradient(33, 47, "RGBA")
    pal = _gradient(29, 31).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    frames = [_gradient(40, 30), _gradient(40, 30).transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    return {
        "png odd size": (_encoded(_gradient(50, 37), "PNG"), "image/png"),
        "jpeg smaller than the crop": (_encoded(_gradient(23, 61), "JPEG", quality=90), "image/jpeg"),
        "jpeg large": (_encoded(_gradient(301, 203), "JPEG"), "image/jpeg"),
        "grayscale png": (_encoded(_gradient(40, 40, "L"), "PNG"), "image/png"),
        "rgba png": (_encoded(rgba, "PNG"), "image/png"),
        "palette png with transparency": (_encoded(pal, "PNG", transparency=3), "image/png"),
        "webp": (_encoded(_gradient(45, 52), "WEBP", quality=80), "image/webp"),
        "animated gif": (buf.getvalue(), "image/gif"),
    }


@pytest.mark.parametrize("name", list(_images()))
def test_preprocessing_matches_transformers(llava, name):
    # the same Pillow decode, RGB conversion (transparency on white), bicubic resize, crop and float32
    # arithmetic as transformers' PIL backend: equal to float32 rounding (1e-6; a one-step difference
    # in a resized uint8 pixel would be 1/255/0.27 = 0.015)
    path, _ = llava
    files = load_model_files(path, progress=False)
    assert files.vision is not None
    data, media = _images()[name]
    proc = transformers.AutoImageProcessor.from_pretrained(path)
    want = proc(images=Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    got = preprocess_image(data, files.vision.processing, media)
    assert got.dtype == np.float32 and got.shape == want.shape == (3, 32, 32)
    diff = float(np.abs(got - want).max())
    assert diff <= 1e-6, f"{name}: max |pixel diff| {diff}"


def test_preprocessing_without_a_preprocessor_config(tmp_path):
    # CLIP's defaults at the tower's image size: shortest edge and crop = image_size
    make_llava(tmp_path / "m", "llava15")
    files = load_model_files(tmp_path / "m", progress=False)
    assert files.vision is not None and files.vision.processing == ImageProcessing(shortest_edge=32, crop=(32, 32))
    proc = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size=32)
    data = _encoded(_gradient(70, 41), "PNG")
    want = proc(images=Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    assert float(np.abs(preprocess_image(data, files.vision.processing) - want).max()) <= 1e-6


def test_exact_resize_without_crop():
    # a SigLIP-style processor: resize to (h, w), no crop
    p = ImageProcessing(shortest_edge=None, size=(24, 20), crop=None, mean=(0.5,) * 3, std=(0.5,) * 3)
    proc = transformers.CLIPImageProcessorPil(size={"height": 24, "width": 20}, do_center_crop=False,
                                              image_mean=[0.5] * 3, image_std=[0.5] * 3)
    data = _encoded(_gradient(57, 31), "PNG")
    want = proc(images=Image.open(io.BytesIO(data)), return_tensors="np")["pixel_values"][0]
    got = preprocess_image(data, p)
    assert got.shape == (3, 24, 20) and float(np.abs(got - want).max()) <= 1e-6


def _png_header(w: int, h: int) -> bytes:
    """A PNG that claims w x h pixels (IHDR, no image data): a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("data, media, match", [
    (b"", "image/png", "empty image"),
    (b"definitely not an image", "image/png", "cannot decode.*PNG, JPEG, WebP or GIF"),
    (_encoded(_gradient(20, 20), "PNG")[:60], "image/png", "cannot decode"),  # truncated
    (_encoded(_gradient(20, 20), "BMP"), "image/bmp", "unsupported image media type"),
    (_encoded(_gradient(20, 20), "BMP"), "", "cannot decode.*PNG, JPEG, WebP or GIF"),  # Pillow reads BMP; we do not
    (_encoded(_gradient(20, 20), "TIFF"), "image/png", "cannot decode"),
    (_png_header(8000, 7000), "image/png", "8000x7000 = 56000000 pixels: more than the 50000000"),
    (_png_header(200_000, 200_000), "image/png", "more than the"),  # past Pillow's own bomb limit too
])
def test_bad_images_are_refused(data, media, match):
    with pytest.raises(ImageError, match=match):
        preprocess_image(data, ImageProcessing(), media)
    assert issubclass(ImageError, ValueError)


def test_pixel_bound_is_checked_before_decoding():
    data = _encoded(_gradient(30, 20), "PNG")
    with pytest.raises(ImageError, match="600 pixels: more than the 599"):
        decode_image(data, "image/png", max_pixels=599)
    assert decode_image(data, "image/png; charset=binary", max_pixels=600).size == (30, 20)
    assert MAX_PIXELS == 50_000_000


def test_embed_image(llava):
    path, model = llava
    be = _backend(path)
    data = _encoded(_gradient(50, 37), "PNG")
    got = embed_image(be, data, "image/png")
    assert got.dtype == np.float32 and got.shape == (16, 64)
    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
    assert float(np.abs(got - _their_features(model, pixels)[0].numpy()).max()) < TOL
    with pytest.raises(ImageError, match="cannot decode"):
        embed_image(be, b"GIF89a-broken", "image/gif")


@pytest.mark.heavy  # (an engine process loads the model; make test runs it)
def test_embed_image_in_an_engine_process(llava):
    # --engine process: the tower runs in the engine process, its vectors those of the in-process backend
    from gpu_backend.engine.client import EngineSpec, ProcessBackend

    path, _ = llava
    data = _encoded(_gradient(50, 37), "PNG")
    want = embed_image(_backend(path), data, "image/png")
    engine = ProcessBackend(EngineSpec(model=str(path), device="cpu", dtype="float32", page_size=4, num_pages=64))
    try:
        assert (engine.info.image_tokens, engine.info.image_token_id) == (16, IMAGE_TOKEN)  # type: ignore[attr-defined]
        got = np.frombuffer(engine.embed_image(data, "image/png"), dtype="<f4").reshape(16, 64)
        np.testing.assert_allclose(got, want, atol=TOL)  # (its own torch threads: summation order)
        with pytest.raises(ValueError, match="cannot decode"):
            engine.embed_image(b"GIF89a-broken", "image/gif")
        ids = [256, 65, 66]
        table = np.frombuffer(engine.input_embeddings(ids), dtype="<f4").reshape(3, 64)
        np.testing.assert_array_equal(table, np.frombuffer(_backend(path).input_embeddings(ids), "<f4").reshape(3, 64))
    finally:
        engine.close()


@pytest.mark.slow  # (two gloo ranks load the model)
def test_an_image_prompt_under_tensor_parallel(llava):
    # --tp 2: rank 0 runs the (unsharded) tower; the pass with the image's vectors, broadcast to both
    # ranks, gives transformers' logits as tp 1 does
    from gpu_backend.engine.client import EngineSpec, ProcessBackend

    path, model = llava
    data = _encoded(_gradient(50, 37), "PNG")
    engine = ProcessBackend(EngineSpec(model=str(path), device="cpu", dtype="float32", page_size=4, num_pages=64,
                                       tp=2))
    try:
        emb = engine.embed_image(data, "image/png")
        np.testing.assert_allclose(np.frombuffer(emb, "<f4").reshape(16, 64),
                                   embed_image(_backend(path), data, "image/png"), atol=TOL)  # (other threads)
        ids = [256, 65, 66] + [IMAGE_TOKEN] * 16 + [67, 68]
        r = req(list(range(32)), 0, ids, 4)
        r.embeds = [(3, emb)]
        [ours] = engine.logits([r])
        pixels = transformers.AutoImageProcessor.from_pretrained(path)(
            images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            ref = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        assert float(np.abs(ours - ref.numpy()).max()) < TOL
    finally:
        engine.close()


def test_text_only_model_has_no_vision(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "text")
    tiny_tokenizer(tmp_path / "text")
    be = _backend(tmp_path / "text")
    assert be.vision is None and be.info.image_token_id is None and be.info.image_tokens == 0
    with pytest.raises(ValueError, match="this model has no vision tower"):
        embed_image(be, _encoded(_gradient(8, 8), "PNG"), "image/png")


def test_config_defaults_match_transformers():
    # llava-1.5's config.json leaves out what equals transformers' defaults: ours must be theirs
    for mt, ours in _TEXT_DEFAULTS.items():
        theirs = transformers.AutoConfig.for_model(mt).to_dict()
        assert {k: theirs[k] for k in ours} == ours, mt
    clip = transformers.CLIPVisionConfig().to_dict()
    assert {k: clip[k] for k in _CLIP_DEFAULTS} == _CLIP_DEFAULTS
    llava_vision = transformers.LlavaConfig().vision_config.to_dict()
    assert {k: llava_vision[k] for k in _LLAVA_VISION} == _LLAVA_VISION


def test_sparse_llava_config_gets_the_defaults(tmp_path):
    # the shape of llava-hf/llava-1.5-7b-hf's config.json: text and vision configs list only what differs
    raw = {"model_type": "llava", "image_token_index": 32000, "projector_hidden_act": "gelu",
           "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "rms_norm_eps": 1e-05,
                           "vocab_size": 32064},
           "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                             "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                             "patch_size": 14, "projection_dim": 768}}
    from gpu_backend.loading.hf_dir import _hf_config, _vision_config

    cfg = _hf_config(raw)
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.vocab_size, cfg.max_position) == \
        (4096, 32, 32, 32064, 4096)
    v = _vision_config(raw, tmp_path, cfg.hidden_size)
    assert v is not None and v.image_tokens == 576 and v.layers_run == 23 and v.activation == "quick_gelu"
    assert v.processing == ImageProcessing(shortest_edge=336, crop=(336, 336))
    with pytest.raises(ValueError, match="unsupported vision tower 'siglip_vision_model'"):
        _vision_config({**raw, "vision_config": {"model_type": "siglip_vision_model"}}, tmp_path, 4096)
    with pytest.raises(ValueError, match="vision_feature_select_strategy 'cls'"):
        _vision_config({**raw, "vision_feature_select_strategy": "cls"}, tmp_path, 4096)


# -- the whole model ------------------------------------------------------------------------------


def test_prompt_with_an_image_matches_transformers(llava):
    # our backend with the image's embeddings in place of its 16 placeholders (`ForwardRequest.embeds`)
    # against LlavaForConditionalGeneration on the same ids and pixel values: every position's logits,
    # then 5 greedy tokens
    path, model = llava
    be = _backend(path)
    data = _encoded(_gradient(50, 37), "PNG")
    emb = embed_image(be, data, "image/png")
    tok = be.tokenizer
    before, after = [256] + tok.encode("USER: "), tok.encode("\nWhat is in the picture? ASSISTANT:")
    ids = before + [IMAGE_TOKEN] * be.info.image_tokens + after
    pixels = transformers.AutoImageProcessor.from_pretrained(path)(
        images=Image.open(io.BytesIO(data)), return_tensors="pt")["pixel_values"]
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0]
        gen = model.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, max_new_tokens=5, do_sample=False,
                             pad_token_id=257, eos_token_id=None)[0, len(ids):].tolist()
    pages = list(range(32))
    r = req(pages, 0, ids, 4)
    r.embeds = [(len(before), emb.tobytes())]
    [ours] = be.logits([r])
    diff = (ours - ref).abs().max().item()
    assert diff < TOL, f"prompt: max |logit diff| {diff}"
    # the image matters: without its embeddings the logits move by far more than the tolerance
    [plain] = be.logits([req(list(range(32, 64)), 0, ids, 4)])
    assert (plain - ref).abs().max().item() > 100 * TOL
    seq = list(ids) + [int(ours[-1].argmax())]
    for _ in range(4):
        [lg] = be.logits([req(pages, len(seq) - 1, seq[-1:], 4)])
        seq.append(int(lg[0].argmax()))
    assert seq[len(ids):] == gen
