"""HF safetensors directories (Llama with llama3 RoPE scaling, Qwen2 with q/k/v biases), tiny random
weights, against transformers on the same directory."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_default_tokenizer
from parity import run_parity

from gpu_backend import load_backend

transformers = pytest.importorskip("transformers")


def make_dir(tmp_path, kind: str):
    hf_tok = hf_default_tokenizer()
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=True, rope_scaling=rope, rope_theta=50000.0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=False, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random init leaves biases at 0: make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    out = tmp_path / kind
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    return out, model.float().eval()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_dir_matches_transformers(tmp_path, kind):
    path, model = make_dir(tmp_path, kind)
    be = load_backend(str(path), device="cpu", dtype=torch.float32, page_size=4, num_pages=64, progress=False)
    assert be.info.vocab_size == 49152 and be.info.stop_tokens == [2]
    cfg = be.model.cfg
    if kind == "llama":
        assert cfg.rope_theta == 50000.0 and cfg.rope_scaling is not None and cfg.tie_embeddings
    else:
        assert cfg.qkv_bias and not cfg.tie_embeddings and cfg.rope_theta == 1e6
    assert be.tokenizer.encode("Hello 123 <|im_end|>") == be.tokenizer.encoding.encode(
        "Hello 123 <|im_end|>", allowed_special="all")
    msgs = [{"role": "user", "content": "Hi"}]
    assert be.tokenizer.apply_chat_template(msgs) == transformers.AutoTokenizer.from_pretrained(
        path).apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    # random weights give flat logits (~0.1): a 1e-4 bound is still ~100x the fp32 noise
    worst = run_parity(be, model, ["The quick brown fox", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14"], 12, 1e-4)
    assert worst < 1e-4
