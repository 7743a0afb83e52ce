"""Embeddings and image prefill per second: our backend against transformers on the same weights,
in the same run (issue 53).

- `text`: the default model (SmolLM2-135M) embedding `--texts` sentences of ~`--words` words, one
  vector each (last-token hidden state after the final norm, L2-normalized, as Qwen3-Embedding's
  pooling): ours runs them as one batch of `OutputSpec(hidden=True)` passes through the paged
  backend; transformers runs `AutoModel` on the padded batch (attention mask, last real token).
- `image`: a random-weight LLaVA-1.5-shaped checkpoint (a CLIP ViT-B/16-sized tower at 224 px:
  196 image tokens, a Llama text model) built here and saved with `save_pretrained`; each image is
  decoded, preprocessed, run through the tower and projector, and prefilled with a short prompt
  around it: ours with `gpu_backend.images.embed_image` and a pass with `ForwardRequest.embeds`;
  transformers with its image processor and `LlavaForConditionalGeneration(input_ids, pixel_values)`.

Reports texts/s and images/s for both and the ratios (ours / transformers), medians of `--repeats`.

    python bench/embeddings.py --json bench/embeddings.json [--quick]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from gpu_backend import load_backend
from gpu_backend.images import embed_image
from gpu_backend.loading.loader import default_model_path
from gpu_backend.types import ForwardRequest, OutputSpec

ROOT = Path(__file__).resolve().parent.parent


def _pages(n: int, ps: int, first: int) -> tuple[list[int], int]:
    count = -(-n // ps)
    return list(range(first, first + count)), n - (count - 1) * ps


def _median_rate(fn: Any, items: int, repeats: int) -> float:
    fn()  # warm up (allocations, lazy inits)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return items / statistics.median(times)


def bench_text(n_texts: int, words: int, repeats: int) -> dict[str, Any]:
    import transformers

    path = default_model_path()
    ours = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=16, num_pages=4096, progress=False)
    tok = ours.tokenizer
    vocab = ["alpha", "river", "stone", "light", "market", "garden", "signal", "winter", "cloud", "paper"]
    texts = [" ".join(vocab[(i * 7 + k * 3) % len(vocab)] for k in range(words)) for i in range(n_texts)]
    ids = [tok.encode(t) for t in texts]
    ps = ours.info.page_size

    def run_ours() -> np.ndarray:
        reqs, first = [], 0
        for k, t in enumerate(ids):
            pages, last = _pages(len(t), ps, first)
            first += len(pages)
            reqs.append(ForwardRequest(pages=pages, last_page_len=last, tokens=t, positions=list(range(len(t))),
                                       outputs=[OutputSpec(index=len(t) - 1, hidden=True)], name=f"text{k}"))
        out = ours.forward(reqs)
        v = np.stack([np.frombuffer(r[0].hidden or b"", dtype="<f4") for r in out])
        return v / np.linalg.norm(v, axis=1, keepdims=True)

    model = transformers.AutoModel.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    longest = max(len(t) for t in ids)
    batch = torch.zeros((len(ids), longest), dtype=torch.long)
    mask = torch.zeros((len(ids), longest), dtype=torch.long)
    for i, t in enumerate(ids):
        batch[i, : len(t)] = torch.tensor(t)
        mask[i, : len(t)] = 1
    last = torch.tensor([len(t) - 1 for t in ids])

    def run_theirs() -> np.ndarray:
        with torch.inference_mode():
            h = model(input_ids=batch, attention_mask=mask).last_hidden_state[torch.arange(len(ids)), last]
        return torch.nn.functional.normalize(h, dim=-1).numpy()

    diff = float(np.abs(run_ours() - run_theirs()).max())
    a, b = _median_rate(run_ours, len(ids), repeats), _median_rate(run_theirs, len(ids), repeats)
    return {"texts": len(ids), "tokens_per_text": statistics.mean(len(t) for t in ids), "ours_per_s": a,
            "transformers_per_s": b, "ratio": a / b, "max_abs_diff": diff}


def _llava_dir(out: Path, quick: bool) -> Any:
    import transformers

    vision = dict(model_type="clip_vision_model", hidden_size=256 if quick else 768, intermediate_size=1024 if quick
                  else 3072, num_hidden_layers=2 if quick else 12, num_attention_heads=4 if quick else 12,
                  image_size=224, patch_size=16, projection_dim=64, hidden_act="quick_gelu")
    text = dict(model_type="llama", vocab_size=32064, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=2048, bos_token_id=1,
                eos_token_id=2)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=32000,
                                   vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).float().eval()
    model.save_pretrained(out)
    sys.path.insert(0, str(ROOT / "tests"))
    from test_backend_vision import tiny_tokenizer  # a byte-level tokenizer with <image> (any ids do here)

    tiny_tokenizer(out)
    transformers.CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size=224).save_pretrained(out)
    return model


def bench_image(n_images: int, repeats: int, quick: bool) -> dict[str, Any]:
    import transformers
    from PIL import Image

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "llava"
        model = _llava_dir(path, quick)
        ours = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=16, num_pages=2048,
                            progress=False)
        proc = transformers.AutoImageProcessor.from_pretrained(path)
    rng = np.random.default_rng(0)
    images = []
    for _ in range(n_images):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (300, 400, 3), dtype=np.uint8)).save(buf, "PNG")
        images.append(buf.getvalue())
    before, after = [1] + list(range(100, 110)), list(range(200, 230))
    n_img = ours.info.image_tokens
    ids = before + [32000] * n_img + after
    ps = ours.info.page_size

    def run_ours() -> None:
        reqs, first = [], 0
        for k, data in enumerate(images):
            vec = embed_image(ours, data, "image/png")
            pages, last = _pages(len(ids), ps, first)
            first += len(pages)
            reqs.append(ForwardRequest(pages=pages, last_page_len=last, tokens=ids, positions=list(range(len(ids))),
                                       outputs=[OutputSpec(index=len(ids) - 1)], name=f"image{k}",
                                       embeds=[(len(before), np.ascontiguousarray(vec, dtype="<f4").tobytes())]))
        ours.logits(reqs)

    def run_theirs() -> None:
        pixels = proc(images=[Image.open(io.BytesIO(d)) for d in images], return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            model(input_ids=torch.tensor([ids] * len(images)), pixel_values=pixels, logits_to_keep=1)

    a, b = _median_rate(run_ours, n_images, repeats), _median_rate(run_theirs, n_images, repeats)
    return {"images": n_images, "image_tokens": n_img, "prompt_tokens": len(ids), "ours_per_s": a,
            "transformers_per_s": b, "ratio": a / b, "tower": "2 layers x 256" if quick else "ViT-B/16 (12 x 768)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=64)
    ap.add_argument("--words", type=int, default=24)
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a few texts and images, a small tower (CI)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.quick:
        args.texts, args.words, args.images, args.repeats = 4, 8, 2, 1
    torch.set_num_threads(max(1, torch.get_num_threads()))
    text = bench_text(args.texts, args.words, args.repeats)
    image = bench_image(args.images, args.repeats, args.quick)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    result = {"text": text, "image": image, "machine": f"{platform.machine()}, {torch.get_num_threads()} threads",
              "commit": commit.strip(), "quick": args.quick}
    print(f"text embeddings: ours {text['ours_per_s']:.1f}/s, transformers {text['transformers_per_s']:.1f}/s "
          f"({text['ratio']:.2f}x; max |diff| {text['max_abs_diff']:.1e})")
    print(f"image prefill:   ours {image['ours_per_s']:.2f}/s, transformers {image['transformers_per_s']:.2f}/s "
          f"({image['ratio']:.2f}x; {image['image_tokens']} image tokens, tower {image['tower']})")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
