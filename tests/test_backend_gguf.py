"""GGUF files of the families llama.cpp converts to them, written here with the `gguf` library as
llama.cpp's converter lays them out (tiny random weights of a transformers model, SmolLM2's tokenizer
fields), against transformers on the same weights; and an unsupported architecture refused from the
header, before the vocabulary is parsed."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from parity import run_parity

from gpu_backend import load_backend
from gpu_backend.loading.gguf import SUPPORTED_ARCHITECTURES, gguf_architecture
from gpu_backend.loading.loader import default_model_path

transformers = pytest.importorskip("transformers")

# HF name (after "model.layers.N.") -> GGUF name (after "blk.N.")
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight",  # Phi-3
}
# Gemma's (llama.cpp's Gemma 2 / 3 converter): four norms, ffn_norm the one before the MLP
GEMMA_NAMES = LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
TOKENIZER_FIELDS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens",
                    "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves the rotary halves of Llama's q/k rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, cfg, state: dict[str, torch.Tensor], vocab: dict | None = None,
               quantized: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None) -> Path:
    """`state` (HF names) as a float32 GGUF of architecture `arch`, with SmolLM2's tokenizer or the
    SentencePiece `vocab` (tokens, scores, types); the tensors in `quantized` are written as the given
    blocks (uint8 [rows, bytes], already in the GGUF's row order) of the given type instead."""
    src = gguf.GGUFReader(str(default_model_path()))
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters.get("full_attention", cfg.rope_parameters)
    w.add_rope_freq_base(rope["rope_theta"])
    gemma = arch.startswith("gemma")
    if arch == "phi3":
        w.add_uint32("phi3.rope.scaling.original_context_length", cfg.original_max_position_embeddings)
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
    if gemma:
        w.add_uint32(f"{arch}.attention.sliding_window", cfg.sliding_window)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, key, None) is not None:
                w.add_float32(f"{arch}.{key}", getattr(cfg, key))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if vocab is None:
        for key in TOKENIZER_FIELDS:
            f = src.fields[key]
            value = f.contents()
            w.add_key_value(key, value, gguf.GGUFValueType(f.types[0]),
                            sub_type=gguf.GGUFValueType(f.types[-1]) if len(f.types) > 1 else None)
    else:
        w.add_tokenizer_model("llama")
        w.add_token_list(vocab["tokens"])
        w.add_token_scores(vocab["scores"])
        w.add_token_types(vocab["types"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, t in state.items():
        arr = t.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1  # llama.cpp stores Gemma's (1 + w)
        if gemma and name == "lm_head.weight":
            continue  # tied
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            g = f"blk.{layer}.{(GEMMA_NAMES if gemma else LAYER_NAMES)[rest]}"
            if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                arr = _permute(arr, cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads)
        if quantized and name in quantized:
            blocks, kind = quantized[name]
            w.add_tensor(g, np.ascontiguousarray(blocks), raw_dtype=kind)
        else:
            w.add_tensor(g, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.slow
def test_qwen3_gguf_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    cfg = transformers.Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = write_gguf(tmp_path / "qwen3.gguf", "qwen3", cfg, model.state_dict())
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)
    assert be.model.cfg.arch == "qwen3" and be.model.cfg.qk_norm and be.model.cfg.head_dim == 32
    run_parity(be, model.float().eval(), ["The quick brown fox", "1, 2, 3, 4, 5, 6, 7"], 32, 1e-4)


def test_unsupported_gguf_architecture_is_refused_from_the_header(tmp_path, monkeypatch):
    path = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_token_list([f"t{i}" for i in range(50_000)])  # a vocabulary we never need to parse
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert gguf_architecture(path) == "mamba"
    assert gguf_architecture(default_model_path()) == "llama"

    def no_parse(*a, **k):
        raise AssertionError("the whole file was parsed before the architecture was checked")

    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'mamba'.*supported are llama, qwen2, qwen3"):
        load_backend(str(path), device="cpu", progress=False)
    assert "qwen3" in SUPPORTED_ARCHITECTURES


def sentencepiece_vocab() -> dict:
    """A SentencePiece-style vocabulary as llama.cpp stores it: pieces by id, scores, token types."""
    import json

    from test_tokenizer_formats import _sentencepiece_json

    tj = json.loads(_sentencepiece_json("prepend"))
    ids = dict(tj["model"]["vocab"]) | {a["content"]: a["id"] for a in tj["added_tokens"]}
    tokens = [""] * (max(ids.values()) + 1)
    for t, i in ids.items():
        tokens[i] = t
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else
             4 if t.startswith("[") else 1 for t in tokens]
    scores = [0.0 if k != 1 else -float(i) for i, k in enumerate(types)]
    return {"tokens": tokens, "scores": scores, "types": types}


@pytest.mark.slow
def test_sentencepiece_gguf_matches_transformers(tmp_path, monkeypatch):
    # a Llama-2 / Mistral / TinyLlama-style GGUF: llama architecture, SentencePiece vocabulary
    from test_tokenizer_formats import CORPUS

    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    vocab = sentencepiece_vocab()
    cfg = transformers.LlamaConfig(vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    path = write_gguf(tmp_path / "spm.gguf", "llama", cfg, model.state_dict(), vocab)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)
    tok = be.tokenizer
    assert not tok.byte_level
    for text in CORPUS:
        ids = tok.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert tok.decode(ids) == theirs.decode(ids), text
        assert tok.encode_prompt(text) == theirs(text)["input_ids"], text  # BOS, as llama.cpp adds it
    run_parity(be, model.float().eval(), ["The quick brown fox", "Hello world! def return"], 32, 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_transformers(tmp_path, monkeypatch, arch):
    # as llama.cpp converts Gemma: norms + 1, softcaps and window in the metadata, a SentencePiece
    # vocabulary; the query scale llama.cpp uses (1 / sqrt(head_dim)) is what the reference model is
    # given, and its sliding layers follow llama.cpp's pattern (every other; five in six)
    from test_tokenizer_formats import CORPUS

    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    vocab = sentencepiece_vocab()
    common = dict(vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, max_position_embeddings=512,
                  sliding_window=6, bos_token_id=1, eos_token_id=2, pad_token_id=0, attn_implementation="eager")
    if arch == "gemma2":
        cfg = transformers.Gemma2Config(**common, num_hidden_layers=2, attn_logit_softcapping=2.0,
                                        final_logit_softcapping=0.5, initializer_range=0.2)
        model = transformers.Gemma2ForCausalLM(cfg)
    else:
        cfg = transformers.Gemma3TextConfig(**common, num_hidden_layers=6)
        model = transformers.Gemma3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, cfg, model.state_dict(), vocab)
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)
    assert be.model.cfg.sandwich_norms and be.model.window == 6
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in CORPUS:
        ids = be.tokenizer.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert be.tokenizer.decode(ids) == theirs.decode(ids), text
        assert be.tokenizer.encode_prompt(text) == theirs(text)["input_ids"], text
    run_parity(be, model.float().eval(), ["The quick brown fox jumps over the lazy dog", "Hello world! def return"],
               32, 1e-4)


@pytest.mark.slow
def test_phi3_gguf_matches_transformers(tmp_path, monkeypatch):
    # as llama.cpp converts Phi-3: fused attn_qkv and ffn_up (gate | up), longrope factor tensors,
    # a SentencePiece vocabulary whose space prefix is a normalizer
    from test_tokenizer_formats import CORPUS

    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    vocab = sentencepiece_vocab()
    cfg = transformers.Phi3Config(
        vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, original_max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0 + 0.25 * i for i in range(8)], "long_factor": [4.0 + i for i in range(8)]})
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(cfg)
    path = write_gguf(tmp_path / "phi3.gguf", "phi3", cfg, model.state_dict(), vocab)
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=256, progress=False)
    assert be.info.max_position == 512 and be.model.rope_switch == 128  # long factors from rope_factors_long
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    for text in CORPUS:
        ids = be.tokenizer.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert be.tokenizer.decode(ids) == theirs.decode(ids), text
    long = " ".join(str(i) for i in range(60))  # past original_max_position_embeddings: the long factors
    assert len(be.tokenizer.encode(long)) > 128
    run_parity(be, model.float().eval(), ["The quick brown fox jumps over the lazy dog", "Hello world! def return", long],
               32, 1e-4)


@pytest.mark.slow
def test_text_completion_raw_prompt_starts_with_bos_as_transformers(tmp_path, monkeypatch):
    # a base model (no chat template) whose SentencePiece tokenizer adds BOS, through the host and the
    # built text_completion: --raw generates what transformers generates from tokenizer(text); without
    # --raw the instance fails saying to use --raw
    from helpers import Run, wasm_bytes

    from host import Host, HostConfig

    monkeypatch.setenv("PIE_CACHE_DIR", str(tmp_path / "cache"))
    vocab = sentencepiece_vocab()
    cfg = transformers.LlamaConfig(vocab_size=len(vocab["tokens"]), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2, initializer_range=0.3)
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = write_gguf(tmp_path / "base.gguf", "llama", cfg, model.state_dict(), vocab)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    prompt, n = "The quick brown fox", 12
    ids = theirs(prompt, return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == 1  # transformers adds BOS
    gen = model.generate(ids, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    want = theirs.decode(gen[0, ids.shape[1]:])
    no_bos = model.generate(ids[:, 1:], max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    assert no_bos[0, ids.shape[1] - 1:].tolist() != gen[0, ids.shape[1]:].tolist()  # BOS changes the answer
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)
    with Host(HostConfig(data_dir=tmp_path / "host"), backend=be) as host:
        program = host.compile(wasm_bytes("text_completion"))
        end = Run(host, program, ["--prompt", prompt, "--raw", "--max-tokens", str(n)]).finish(120)
        assert end.event == "completed", end.message
        assert end.message == want
        end = Run(host, program, ["--prompt", prompt]).finish(120)
        assert end.event == "exception" and "no chat template" in end.message and "--raw" in end.message
