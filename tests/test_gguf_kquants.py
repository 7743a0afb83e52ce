"""GGUF K-quants (Q4_K, Q5_K, Q6_K) and Q8_0: blocks dequantized as llama.cpp's reference C code
(`dequantize_row_*` in ggml-quants.c, transcribed below one value at a time) dequantizes them, and
a tiny Llama GGUF whose matrices are in those types against transformers on the same values. The
`gguf` package has no quantizer for the K types, so their blocks are random bytes (with scales
that keep the weights small); Q8_0 blocks come from the package's own quantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quantize
from parity import run_parity
from test_backend_gguf import _permute, write_gguf

from gpu_backend import load_backend
from gpu_backend.loading.loader import load_model_files

transformers = pytest.importorskip("transformers")

QK_K = 256
BLOCK_BYTES = {Q.Q4_K: 144, Q.Q5_K: 176, Q.Q6_K: 210, Q.Q8_0: 34}
BLOCK_VALUES = {Q.Q4_K: QK_K, Q.Q5_K: QK_K, Q.Q6_K: QK_K, Q.Q8_0: 32}


def _f16(b: np.ndarray) -> float:
    return float(b[:2].view(np.float16)[0])


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    # get_scale_min_k4: 6-bit scales and mins packed in 12 bytes
    if j < 4:
        return int(q[j] & 63), int(q[j + 4] & 63)
    return int((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4)), int((q[j + 4] >> 4) | ((q[j] >> 6) << 4))


def reference_block(kind: Q, b: np.ndarray) -> list[float]:
    """One block's values, as llama.cpp's dequantize_row_{q8_0,q4_K,q5_K,q6_K} computes them."""
    y: list[float] = []
    if kind == Q.Q8_0:  # d, qs[32]
        d = _f16(b)
        return [d * int(v) for v in b[2:34].view(np.int8)]
    if kind in (Q.Q4_K, Q.Q5_K):  # d, dmin, scales[12], (qh[32],) qs[128]
        d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
        qh = b[16:48] if kind == Q.Q5_K else None
        qs = b[48:176] if kind == Q.Q5_K else b[16:144]
        for n in range(QK_K // 64):  # 64 values a step: 32 low nibbles, 32 high
            sc1, m1 = _scale_min_k4(2 * n, scales)
            sc2, m2 = _scale_min_k4(2 * n + 1, scales)
            ql = qs[32 * n: 32 * n + 32]
            for lo, (sc, m, shift) in enumerate(((sc1, m1, 0), (sc2, m2, 4))):
                for v in range(32):
                    q = (int(ql[v]) >> shift) & 0xF
                    if qh is not None and qh[v] & (1 << (2 * n + lo)):
                        q += 16
                    y.append(d * sc * q - dmin * m)
        return y
    # Q6_K: ql[128], qh[64], scales[16] (int8), d
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b[208:210])
    out = [0.0] * QK_K
    for half in range(2):
        L, H, S, base = ql[64 * half:], qh[32 * half:], sc[8 * half:], 128 * half
        for v in range(32):
            s = v // 16
            q1 = ((int(L[v]) & 0xF) | (((int(H[v]) >> 0) & 3) << 4)) - 32
            q2 = ((int(L[v + 32]) & 0xF) | (((int(H[v]) >> 2) & 3) << 4)) - 32
            q3 = ((int(L[v]) >> 4) | (((int(H[v]) >> 4) & 3) << 4)) - 32
            q4 = ((int(L[v + 32]) >> 4) | (((int(H[v]) >> 6) & 3) << 4)) - 32
            out[base + v] = d * int(S[s]) * q1
            out[base + v + 32] = d * int(S[s + 2]) * q2
            out[base + v + 64] = d * int(S[s + 4]) * q3
            out[base + v + 96] = d * int(S[s + 6]) * q4
    return out


def reference(kind: Q, raw: np.ndarray) -> np.ndarray:
    """A [rows, bytes] tensor of blocks dequantized by `reference_block`, [rows, values]."""
    n = BLOCK_BYTES[kind]
    return np.array([[v for k in range(0, len(row), n) for v in reference_block(kind, row[k:k + n])]
                     for row in raw], dtype=np.float32)


def random_blocks(kind: Q, rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random K-quant blocks (uint8 [rows, bytes]) with their fp16 scale fields set near `scale`."""
    n = cols // BLOCK_VALUES[kind]
    raw = rng.integers(0, 256, size=(rows, n, BLOCK_BYTES[kind]), dtype=np.uint8)
    at = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[kind]  # d (and dmin)
    for off in at:
        d = (rng.uniform(0.5, 1.5, size=(rows, n)) * scale).astype(np.float16)
        raw[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, n, 2)
    return raw.reshape(rows, n * BLOCK_BYTES[kind])


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0])
def test_blocks_dequantize_as_llama_cpp_reference(kind):
    from gguf import dequantize

    rng = np.random.default_rng(int(kind))
    if kind == Q.Q8_0:
        raw = quantize(rng.standard_normal((3, 256)).astype(np.float32), kind)
    else:
        raw = random_blocks(kind, 3, 512, rng, 1e-3)
    np.testing.assert_allclose(dequantize(raw, kind), reference(kind, raw), rtol=1e-6, atol=1e-9)


# the tiny model's matrices and the type each is written in (every K row is 256 or 512 values)
KINDS = {"self_attn.q_proj": Q.Q4_K, "self_attn.k_proj": Q.Q5_K, "self_attn.v_proj": Q.Q6_K,
         "self_attn.o_proj": Q.Q8_0, "mlp.gate_proj": Q.Q4_K, "mlp.up_proj": Q.Q5_K, "mlp.down_proj": Q.Q6_K}
SCALES = {Q.Q4_K: 2e-5, Q.Q5_K: 1e-5, Q.Q6_K: 5e-6}  # d, so that weights stay within about +-0.02


@pytest.mark.slow
def test_kquant_gguf_loads_and_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                   max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    rng = np.random.default_rng(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    raw: dict[str, tuple[np.ndarray, Q]] = {}
    for name, t in state.items():
        kind = next((KINDS[k] for k in KINDS if f".{k}." in name), None)
        if name == "lm_head.weight":
            kind = Q.Q6_K
        elif name == "model.embed_tokens.weight":
            kind = Q.Q8_0
        if kind is None:
            continue
        rows, cols = t.shape
        if kind == Q.Q8_0:
            blocks = quantize(t.float().numpy(), kind)
        else:
            blocks = random_blocks(kind, rows, cols, rng, SCALES[kind])
        values = reference(kind, blocks)  # what transformers is given: the values the blocks hold
        state[name] = torch.from_numpy(values)
        if "q_proj" in name or "k_proj" in name:  # llama.cpp's row order; a row is whole blocks
            order = _permute(np.arange(rows)[:, None], cfg.num_attention_heads if "q_proj" in name
                             else cfg.num_key_value_heads)[:, 0]
            blocks = blocks[order]
        raw[name] = (blocks, kind)
    model.load_state_dict(state)
    path = write_gguf(tmp_path / "kquants.gguf", "llama", cfg, state, quantized=raw)
    files = load_model_files(path, progress=False)
    for name, (_, kind) in raw.items():  # each tensor as the reference formulas give it
        np.testing.assert_allclose(files.weights[name].numpy(), state[name].numpy(), rtol=1e-6, atol=1e-9,
                                   err_msg=f"{name} ({kind.name})")
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)
    run_parity(be, model.float(), ["The quick brown fox", "1, 2, 3, 4, 5, 6, 7"], 32, 1e-4)
    # bf16: dequantized into bf16 and cached as bf16, next to the float32 cache (half its size)
    bf = load_backend(str(path), device="cpu", dtype=torch.bfloat16, page_size=4, num_pages=64, progress=False)
    assert bf.model.layers[0].qkv.dtype == torch.bfloat16
    size = {p.name.rsplit("-", 2)[1]: p.stat().st_size for p in (tmp_path / "cache").glob("*.safetensors")}
    assert set(size) == {"float32", "bfloat16"} and size["bfloat16"] < 0.51 * size["float32"]
    down = "model.layers.1.mlp.down_proj.weight"  # Q6_K
    torch.testing.assert_close(load_model_files(path, progress=False, dtype=torch.bfloat16).weights[down],
                               state[down].to(torch.bfloat16), rtol=0, atol=0)  # one rounding, from the values
