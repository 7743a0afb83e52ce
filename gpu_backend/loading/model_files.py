"""What a loaded model is made of, whichever file it came from: `LoadedModel` and `TokenizerSpec`,
plus the pre-tokenizer split patterns that GGUF and HF tokenizer files refer to.

Weights are under Hugging Face names (`model.layers.0.self_attn.q_proj.weight`, ...), so the model
code has one naming scheme.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpu_backend.models.config import ModelConfig, VisionConfig

if TYPE_CHECKING:  # (a tokenizer alone, as in an instance worker, does not import torch)
    import torch

__all__ = [
    "CL100K_PATTERN",
    "GGUF_PRE_PATTERNS",
    "GPT2_PATTERN",
    "QWEN2_PATTERN",
    "SMOLLM_PATTERN",
    "LoadedModel",
    "TokenizerSpec",
]

# GPT-2's split pattern, with digits split one by one (the `smollm` pre-tokenizer: a Digits split
# followed by byte-level GPT-2). A whitespace run that ends at a digit is taken whole, as it is when
# the digits are split off first.
SMOLLM_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+|\s+(?=\p{N})|\s+(?!\S)|\s+"""
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3 / Qwen2 (cl100k-style) pattern, used by GGUF pre-tokenizers "llama-bpe" and "qwen2".
CL100K_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
GGUF_PRE_PATTERNS = {
    "smollm": SMOLLM_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "gpt2": GPT2_PATTERN,
    "llama-bpe": CL100K_PATTERN,
    "llama3": CL100K_PATTERN,
    "qwen2": QWEN2_PATTERN,
}


@dataclass
class TokenizerSpec:
    """A BPE vocabulary, of one of two layouts.

    Byte-level (GPT-2, Llama 3, Qwen, SmolLM): `tokens[i]` is token i in GPT-2's byte-to-unicode
    form, split by `pattern` (run by tiktoken) after the Unicode `normalizer` form (NFC, ...) if any.
    SentencePiece-style (Llama 2, Mistral, Gemma, Phi-3; `sentencepiece` set to the tokenizer.json
    text, run by the `tokenizers` library as transformers does): `tokens[i]` is the piece, "▁" for
    a space, `<0xNN>` for a byte-fallback byte.
    """

    tokens: list[str]
    special: dict[str, int]  # tokens recognised verbatim in text (control / added tokens)
    pattern: str
    chat_template: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    stop_tokens: list[int]
    normalizer: str | None = None
    sentencepiece: str | None = None
    # a raw prompt starts with BOS (the tokenizer.json post-processor's template; GGUF add_bos_token),
    # as transformers' `tokenizer(text)` and llama.cpp add it; a rendered chat template has its own
    add_bos: bool = False
    # ...and ends with these (the post-processor's template after the text: Qwen3-Embedding's EOS)
    suffix: list[int] = field(default_factory=list)


@dataclass
class LoadedModel:
    """A model's files read: the text model's config and weights (HF names), its tokenizer, and for a
    vision-language checkpoint (LLaVA) the vision side's config and weights (`vision_tower.*`,
    `multi_modal_projector.*`: `gpu_backend.models.vision.vision_weight_name`)."""

    name: str
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: TokenizerSpec
    vision: VisionConfig | None = None
    vision_weights: dict[str, torch.Tensor] = field(default_factory=dict)
