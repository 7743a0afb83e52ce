"""Read an HF directory's tokenizer: tokenizer.json (its layout checked first), tokenizer_config.json,
chat_template.jinja and generation_config.json, into a `TokenizerSpec`.

Two layouts are run (`gpu_backend.loading.tokenizer`): byte-level BPE, on tiktoken with the split pattern
of its pre-tokenizer and its Unicode normalizer; SentencePiece-style BPE, on the `tokenizers`
library with the file as it is. Anything else is refused with the list of what is supported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_backend.loading.model_files import GPT2_PATTERN, SMOLLM_PATTERN, TokenizerSpec

__all__ = ["SUPPORTED_TOKENIZERS", "hf_tokenizer"]


def _hf_pattern(pre: dict[str, Any] | None) -> str:
    if pre is None:
        return GPT2_PATTERN
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    digits = any(s.get("type") == "Digits" and s.get("individual_digits") for s in steps)
    for s in steps:
        if s.get("type") == "Split" and "Regex" in s.get("pattern", {}):
            return str(s["pattern"]["Regex"])
    if any(s.get("type") == "ByteLevel" for s in steps):
        return SMOLLM_PATTERN if digits else GPT2_PATTERN
    raise ValueError(f"unsupported pre-tokenizer in tokenizer.json: {pre}")


SUPPORTED_TOKENIZERS = (
    "byte-level BPE (a ByteLevel pre-tokenizer, optionally with Split / Digits steps and an NFC, NFD, "
    "NFKC or NFKD normalizer) and SentencePiece-style BPE (a Metaspace pre-tokenizer, or a Prepend / "
    "Replace normalizer with no pre-tokenizer; byte fallback)"
)
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")


def _steps(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The steps of a tokenizer.json normalizer / pre-tokenizer / decoder (a Sequence flattened)."""
    if node is None:
        return []
    return list(node.get(key, [])) if node.get("type") == "Sequence" else [node]


def _tokenizer_layout(tj: dict[str, Any], where: str) -> tuple[str | None, bool]:
    """(Unicode normalizer form, SentencePiece-style?) of a tokenizer.json; ValueError naming the
    layout and listing the supported ones otherwise."""
    model = tj.get("model", {}).get("type")
    norms = _steps(tj.get("normalizer"), "normalizers")
    pres = _steps(tj.get("pre_tokenizer"), "pretokenizers")
    kinds = {n.get("type") for n in norms}
    pre_kinds = {p.get("type") for p in pres}
    # Gemma's files also split on " " after the normalizer has replaced every space: a no-op
    spaces_only = all(p.get("type") == "Split" and p.get("pattern") == {"String": " "} for p in pres)
    sp = "Metaspace" in pre_kinds or (spaces_only and any(
        n.get("type") == "Replace" and n.get("content") == "\u2581" for n in norms))
    if model != "BPE" or (not sp and (not pre_kinds & {"ByteLevel"} or kinds - set(_UNICODE_FORMS))):
        raise ValueError(f"{where}: unsupported tokenizer (model {model}, normalizer {sorted(map(str, kinds))}, "
                         f"pre-tokenizer {sorted(map(str, pre_kinds))}): supported are {SUPPORTED_TOKENIZERS}")
    if sp:
        return None, True
    forms = [n["type"] for n in norms]
    if len(forms) > 1:
        raise ValueError(f"{where}: unsupported normalizer {forms}: one of {_UNICODE_FORMS} at most")
    return (forms[0] if forms else None), False


def _post_processor_bos(tj: dict[str, Any], vocab: dict[str, int]) -> int | None:
    """The special token the post-processor puts before a single sequence (a TemplateProcessing whose
    `single` template starts with one), or None."""
    for step in _steps(tj.get("post_processor"), "processors"):
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            first = step["single"][0]
            if "SpecialToken" in first:
                return vocab.get(first["SpecialToken"]["id"])
    return None


def _post_processor_suffix(tj: dict[str, Any], vocab: dict[str, int]) -> list[int]:
    """The special tokens the post-processor puts after a single sequence (a TemplateProcessing whose
    `single` template ends with them: Qwen3-Embedding's "$A <|endoftext|>", the token its embedding
    is pooled at), [] for none."""
    for step in _steps(tj.get("post_processor"), "processors"):
        if step.get("type") == "TemplateProcessing" and step.get("single"):
            names = []
            for item in reversed(step["single"]):
                if "SpecialToken" not in item:
                    break
                names.append(item["SpecialToken"]["id"])
            out: list[int] = []
            for name in reversed(names):
                ids = (step.get("special_tokens") or {}).get(name, {}).get("ids")
                out += [int(i) for i in ids] if ids else [vocab[name]] if name in vocab else []
            return out
    return []


def hf_tokenizer(path: Path, cfg: dict[str, Any]) -> TokenizerSpec:
    """The tokenizer of HF directory `path` (`cfg`: its config.json, for BOS/EOS ids it may hold)."""
    if not (path / "tokenizer.json").exists():
        extra = " (only tokenizer.model there: save the tokenizer with transformers' save_pretrained to write " \
                "tokenizer.json)" if (path / "tokenizer.model").exists() else ""
        raise FileNotFoundError(f"{path}: tokenizer.json missing{extra}")
    text = (path / "tokenizer.json").read_text(encoding="utf-8")
    tj = json.loads(text)
    normalizer, sentencepiece = _tokenizer_layout(tj, f"{path}/tokenizer.json")
    vocab: dict[str, int] = dict(tj["model"]["vocab"])
    special: dict[str, int] = {}
    for added in tj.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        special[added["content"]] = added["id"]
    tokens = [""] * (max(vocab.values()) + 1)
    for tok, i in vocab.items():
        tokens[i] = tok
    tc_file = path / "tokenizer_config.json"
    tc = json.loads(tc_file.read_text(encoding="utf-8")) if tc_file.exists() else {}
    template = tc.get("chat_template") or ""
    if (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")

    def tok_id(key: str) -> int | None:
        v = tc.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return vocab.get(v) if isinstance(v, str) else None

    bos = tok_id("bos_token") if tok_id("bos_token") is not None else cfg.get("bos_token_id")
    eos = tok_id("eos_token") if tok_id("eos_token") is not None else cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0]
    stops: set[int] = set()
    gc_file = path / "generation_config.json"
    for src in (cfg, json.loads(gc_file.read_text()) if gc_file.exists() else {}):
        e = src.get("eos_token_id")
        stops.update(e if isinstance(e, list) else [] if e is None else [e])
    if eos is not None:
        stops.add(int(eos))
    prefix = _post_processor_bos(tj, vocab)
    if prefix is not None:
        bos = prefix
    return TokenizerSpec(
        tokens=tokens,
        special=special,
        pattern="" if sentencepiece else _hf_pattern(tj.get("pre_tokenizer")),
        chat_template=template,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=tok_id("pad_token"),
        stop_tokens=sorted(int(s) for s in stops),
        normalizer=normalizer,
        sentencepiece=text if sentencepiece else None,
        add_bos=prefix is not None,
        suffix=_post_processor_suffix(tj, vocab),
    )
