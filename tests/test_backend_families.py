"""The families users bring (Qwen3, Mistral with its sliding window, Gemma 2, Gemma 3, Phi-3) from HF
safetensors directories against transformers on the same weights: tiny random-weight models saved
with `save_pretrained`, first-forward logits and 32 greedy tokens (tests/parity.py), on SDPA and flex.
Each family-specific feature has a test that fails when it is ignored (the window, soft-capping)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from backend_checks import Pages, req
from helpers import hf_default_tokenizer
from parity import run_parity

from gpu_backend.attention.flex import FlexAttention
from gpu_backend.build import backend_from_weights, make_attention
from gpu_backend.loading.hf_dir import MULTIMODAL, SUPPORTED_MODEL_TYPES
from gpu_backend.loading.loader import load_model_files

transformers = pytest.importorskip("transformers")

WINDOW = 8  # tokens: every prompt below is longer, and 32 decode steps go far past it
PROMPTS = ["The quick brown fox jumps over the lazy dog, then runs",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14"]
STEPS = 32
TOL = 1e-4  # random weights give logits of ~0.1-1: still ~100x the float32 noise


def _configs() -> dict[str, object]:
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0)
    gemma = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW, attn_implementation="eager")
    return {
        "qwen3": transformers.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "mistral": transformers.MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False),
        # small caps so they bite on random weights (the real ones are 50 and 30 on real logits)
        "gemma2": transformers.Gemma2Config(**common, **gemma, attn_logit_softcapping=2.0,
                                            final_logit_softcapping=0.5, initializer_range=0.2),
        "gemma3_text": transformers.Gemma3TextConfig(
            **common, **gemma, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}}),
        "phi3": transformers.Phi3Config(
            **common, tie_word_embeddings=False, original_max_position_embeddings=128,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "short_factor": [1.0 + 0.25 * i for i in range(8)],
                             "long_factor": [4.0 + i for i in range(8)]}),
    }


MODELS = {
    "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    return hf_default_tokenizer()


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, hf_tokenizer, request):
    """(directory, transformers model) of one family, random weights, norms and biases made to matter."""
    kind = request.param
    torch.manual_seed(0)
    model = getattr(transformers, MODELS[kind])(_configs()[kind])
    with torch.no_grad():  # the init leaves norms at 1 (Gemma: 0) and biases at 0
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    out = tmp_path_factory.mktemp("families") / kind
    model.save_pretrained(out)
    hf_tokenizer.save_pretrained(out)
    return out, model.float().eval()


def ours(path: Path, attention: str = "sdpa", **change: object):
    """Our backend on the directory's files, with `change` applied to the parsed config (to check a
    test fails when a feature is ignored)."""
    files = load_model_files(path, progress=False)
    cfg = replace(files.config, **change)
    attn = FlexAttention(min_batch=4) if attention == "flex" else make_attention(attention)
    return backend_from_weights(cfg, files.weights, files.tokenizer, files.name, device=torch.device("cpu"),
                                dtype=torch.float32, page_size=4, num_pages=128, attention=attn)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", list(MODELS), indirect=True)
def test_family_matches_transformers(family_dir):
    path, model = family_dir
    be = ours(path)
    cfg = be.model.cfg
    assert cfg.arch == model.config.model_type
    worst = run_parity(be, model, PROMPTS, STEPS, TOL)
    assert worst < TOL


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["mistral", "gemma2", "gemma3_text"], indirect=True)
def test_window_on_flex_matches_transformers(family_dir):
    path, model = family_dir
    run_parity(ours(path, "flex"), model, PROMPTS, STEPS, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["mistral", "gemma2", "gemma3_text"], indirect=True)
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_ignoring_the_window_fails(family_dir, attention):
    path, model = family_dir
    assert ours(path).model.window == WINDOW
    with pytest.raises(AssertionError, match="logit diff"):
        run_parity(ours(path, attention, sliding_window=0, sliding_layers=()), model, PROMPTS, STEPS, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["gemma2"], indirect=True)
@pytest.mark.parametrize("change", [{"attn_softcap": None}, {"final_softcap": None}], ids=["attn", "final"])
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_ignoring_softcapping_fails(family_dir, change, attention):
    path, model = family_dir
    run_parity(ours(path, attention), model, PROMPTS[:1], 2, TOL)
    with pytest.raises(AssertionError, match="logit diff"):
        run_parity(ours(path, attention, **change), model, PROMPTS[:1], 2, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["mistral", "gemma2"], indirect=True)
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_mixed_batch_with_brle_past_the_window(family_dir, attention):
    """One batch: a decode step far past the window, a prefill longer than the window, and a prefill
    whose rows come as BRLE masks (causal written out) -- each equal to transformers."""
    path, model = family_dir
    be = ours(path, attention)
    ps = be.info.page_size
    ids = be.tokenizer.encode(PROMPTS[0] + " " + PROMPTS[1])
    assert len(ids) > 3 * WINDOW
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0]
    pg = Pages(be)
    dec_pages, pre_pages, brle_pages = pg.for_tokens(len(ids)), pg.for_tokens(len(ids)), pg.for_tokens(len(ids))
    be.logits([req(dec_pages, 0, ids[:-1], ps, outputs=[])])  # the decoding request's context
    n = len(ids)
    brle = [[i + 1] for i in range(n)]  # row i attends to slots 0..i: causal as BRLE
    out = be.logits([req(dec_pages, n - 1, ids[-1:], ps), req(pre_pages, 0, ids, ps),
                     req(brle_pages, 0, ids, ps, mask=brle)])
    for what, got, want in (("decode", out[0][0], ref[-1]), ("prefill", out[1], ref), ("brle", out[2], ref)):
        diff = (got - want).abs().max().item()
        assert diff < TOL, f"{what}: max |logit diff| {diff}"


def test_unsupported_model_type_is_refused_before_the_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "falcon", "hidden_size": 8}')
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'.*qwen3.*phi3.*gemma2"):
        load_model_files(tmp_path, progress=False)  # no weights there: refused first
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3"} <= set(SUPPORTED_MODEL_TYPES)


def test_help_names_the_supported_families():
    from gpu_backend.loading.gguf import SUPPORTED_ARCHITECTURES
    from host.cli.options import MODEL_FAMILIES
    from host.cli.run import _parser

    for name in SUPPORTED_MODEL_TYPES + tuple(MULTIMODAL) + SUPPORTED_ARCHITECTURES:
        assert name in MODEL_FAMILIES
    assert "Gemma 3" in " ".join(_parser().format_help().split())


LONG_PROMPT = " ".join(str(i) for i in range(80))  # past Phi-3's original_max_position_embeddings (128)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["phi3"], indirect=True)
def test_phi3_long_factors_past_the_original_context(family_dir):
    # longrope: a sequence longer than original_max_position_embeddings is rotated with the long
    # factors (all of a prompt that long), a shorter one with the short factors, in the same batch
    path, model = family_dir
    be = ours(path)
    assert be.info.max_position == 512 and be.model.rope_switch == 128
    assert len(be.tokenizer.encode(LONG_PROMPT)) > 128
    run_parity(be, model, [LONG_PROMPT, PROMPTS[0]], 8, TOL)
    scaling = be.model.cfg.rope_scaling
    with pytest.raises(AssertionError, match="logit diff"):  # the long factors ignored
        run_parity(ours(path, rope_scaling={**scaling, "long_factor": scaling["short_factor"]}), model,
                   [LONG_PROMPT], 1, TOL)


def _greedy_logits(be, ids: list[int], steps: int) -> list[torch.Tensor]:
    """Our logits of a prefill of `ids` and `steps` greedy decode steps, one pass each."""
    pages, out, seq, new = list(range(64)), [], list(ids), list(ids)
    for _ in range(steps + 1):
        [lg] = be.logits([req(pages, len(seq) - len(new), new, 4, outputs=[len(new) - 1])])
        out.append(lg[0])
        seq.append(int(lg[0].argmax()))
        new = seq[-1:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["phi3"], indirect=True)
def test_phi3_decode_across_the_original_context_as_transformers(family_dir):
    # a prompt shorter than original_max_position_embeddings decoded past it: transformers (with its
    # cache, as generate runs) rotates each new token with the long factors from there on, while
    # the keys already cached keep the short ones; so do we
    path, model = family_dir
    be = ours(path)
    ids = be.tokenizer.encode(LONG_PROMPT)[:120]
    ours_steps = _greedy_logits(be, ids, 16)
    theirs = []
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        for _ in range(17):
            theirs.append(out.logits[0, -1])
            out = model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
    worst = max(float((a - b).abs().max()) for a, b in zip(ours_steps, theirs, strict=True))
    assert worst < TOL, f"logit diff {worst}"
    scaling = be.model.cfg.rope_scaling
    short = _greedy_logits(ours(path, rope_scaling={**scaling, "long_factor": scaling["short_factor"]}), ids, 16)
    assert max(float((a - b).abs().max()) for a, b in zip(short[9:], theirs[9:], strict=True)) > 10 * TOL


@pytest.mark.slow
def test_gemma3_multimodal_checkpoint_runs_its_text_model(tmp_path, hf_tokenizer):
    # Gemma 3 4B and up are `gemma3` checkpoints (text model + vision tower): the text model loads,
    # the vision weights are not read
    text = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=WINDOW,
                layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "g3")
    hf_tokenizer.save_pretrained(tmp_path / "g3")
    files = load_model_files(tmp_path / "g3", progress=False)
    assert files.config.arch == "gemma3_text" and files.config.window == WINDOW
    assert not any("vision" in k or "projector" in k for k in files.weights)
    run_parity(ours(tmp_path / "g3"), model.float().eval(), PROMPTS, STEPS, TOL)


@pytest.mark.slow
@pytest.mark.parametrize("family_dir", ["qwen3"], indirect=True)
def test_hf_weights_are_cast_to_the_serving_dtype_as_read(family_dir):
    # a float32 checkpoint served in bf16: every tensor bf16 once read (no float32 copy of the model)
    path, model = family_dir
    files = load_model_files(path, progress=False, dtype=torch.bfloat16)
    assert {t.dtype for t in files.weights.values()} == {torch.bfloat16}
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(files.weights[name], model.state_dict()[name].to(torch.bfloat16))
    assert {t.dtype for t in load_model_files(path, progress=False).weights.values()} == {torch.float32}
