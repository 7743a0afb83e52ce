"""tokenizer.json layouts other than SmolLM2's, against transformers on the same file: SentencePiece-style
BPE (the older Prepend/Replace normalizer layout of Llama 2 / Mistral / Phi-3, Gemma's Replace-only
one, the Metaspace pre-tokenizer) with byte fallback, a byte-level one with an NFC normalizer (Qwen2),
ids past the vocabulary, and the refusal of layouts we do not run. The SentencePiece files are built
here with the `tokenizers` library (a small BPE trained on a fixed corpus, plus the 256 byte pieces)."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pytest
from helpers import hf_default_tokenizer

from gpu_backend.loading.hf_tokenizer import hf_tokenizer
from gpu_backend.loading.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CORPUS = [
    "Hello world!",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café, Ünïcödé, straße",
    unicodedata.normalize("NFD", "naïve café, Ünïcödé (NFD)"),
    "日本語のテキストと中文文本，한국어 텍스트",
    "emoji: 😀🚀👨‍👩‍👧‍👦 ❤️ 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\n",
    "   leading and trailing spaces   ",
    "numbers 1234567890 3.14159 -42",
    "<s>[INST] Hi there [/INST]</s> text after",
    "",
]
TRAIN = ["The quick brown fox jumps over the lazy dog. Hello world! def return pass if numbers 123"] * 20


def _sentencepiece_json(layout: str) -> str:
    """A SentencePiece-style BPE tokenizer.json: <unk> <s> </s>, the 256 byte pieces, trained pieces."""
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    t = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    t.normalizer = normalizers.Replace(" ", "\u2581")
    t.train_from_iterator(TRAIN, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    trained = json.loads(t.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in trained["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True,
                                          fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_tokens(["[INST]", "[/INST]"])
    if layout == "prepend":  # Llama 2, Mistral, Phi-3
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    elif layout == "replace":  # Gemma: no space prepended (and a split on spaces the normalizer removed)
        tok.normalizer = normalizers.Replace(" ", "\u2581")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    else:  # Metaspace pre-tokenizer (files written by newer tokenizers)
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
        tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(replacement="\u2581",
                                                                                     prepend_scheme="first")])
    return tok.to_str()


def _write(path: Path, tokenizer_json: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return path


def _pair(path: Path) -> tuple[Tokenizer, object]:
    ours = Tokenizer(hf_tokenizer(path, {}))
    theirs = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"),
                                                  clean_up_tokenization_spaces=False)
    return ours, theirs


@pytest.fixture(scope="module", params=["prepend", "replace", "metaspace"])
def sentencepiece(request, tmp_path_factory):
    return _pair(_write(tmp_path_factory.mktemp(request.param), _sentencepiece_json(request.param)))


@pytest.mark.parametrize("text", CORPUS)
def test_sentencepiece_layouts_match_transformers(sentencepiece, text):
    ours, theirs = sentencepiece
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == theirs.decode(ids)


def test_sentencepiece_byte_fallback_and_specials(sentencepiece):
    ours, _ = sentencepiece
    ids = ours.encode("😀</s>")
    assert ids[-1] == 2 and any(3 <= i < 259 for i in ids)  # the emoji spelled in byte pieces
    assert "😀" in ours.decode(ids[:-1])
    assert "\ufffd" not in ours.decode(ids[:-2]) and "😀" not in ours.decode(ids[:-2])  # a partial char held back
    assert not ours.byte_level and ours.is_special(2)


@pytest.fixture(scope="module")
def nfc_dir(tmp_path_factory):
    """SmolLM2's byte-level tokenizer.json with an NFC normalizer (as Qwen2's has)."""
    hf = hf_default_tokenizer()
    out = tmp_path_factory.mktemp("nfc")
    hf.save_pretrained(out)
    tj = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    tj["normalizer"] = {"type": "NFC"}
    (out / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def nfc_pair(nfc_dir):
    """Ours and transformers' tokenizer of `nfc_dir`, loaded once for the module (~1-2 s each time)."""
    return _pair(nfc_dir)


@pytest.mark.parametrize("text", CORPUS)
def test_nfc_normalizer_matches_transformers(nfc_pair, text):
    ours, theirs = nfc_pair
    assert ours.encode(text) == theirs.encode(text, add_special_tokens=False)


def test_ids_past_the_vocabulary_decode_to_nothing(nfc_pair):
    # Qwen2's model vocabulary (151,936) runs past its tokenizer's (151,669 + added): transformers
    # decodes those ids to '' rather than failing
    ours, theirs = nfc_pair
    past = ours.vocab_size + 5
    assert ours.decode([past]) == theirs.decode([past]) == ""
    hello = ours.encode("Hello")
    assert ours.decode(hello + [past]) == theirs.decode(hello + [past]) == "Hello"


def test_unsupported_tokenizer_is_refused_with_the_supported_list(tmp_path):
    from tokenizers import models, pre_tokenizers

    wp = tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    wp.pre_tokenizer = pre_tokenizers.Whitespace()
    path = _write(tmp_path / "wp", wp.to_str())
    with pytest.raises(ValueError, match="unsupported tokenizer.*WordPiece.*supported are byte-level BPE.*SentencePiece"):
        hf_tokenizer(path, {})


@pytest.mark.parametrize("layout", ["prepend", "metaspace"])
def test_raw_prompt_starts_with_bos_where_the_post_processor_adds_it(tmp_path, layout):
    from tokenizers import processors

    tok = tokenizers.Tokenizer.from_str(_sentencepiece_json(layout))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    ours, theirs = _pair(_write(tmp_path / layout, tok.to_str()))
    for text in ("Hello world", "<s>Hello", ""):
        assert ours.encode_prompt(text) == theirs(text)["input_ids"]
        assert ours.encode_prompt(text)[0] == 1 and ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    # without a post-processor nothing is added (SmolLM2's own tokenizer adds no BOS either)
    plain, plain_theirs = _pair(_write(tmp_path / "plain", _sentencepiece_json(layout)))
    assert plain.encode_prompt("Hello") == plain_theirs("Hello")["input_ids"] == plain.encode("Hello")


def test_raw_prompt_ends_with_what_the_post_processor_appends(tmp_path):
    # Qwen3-Embedding's tokenizer.json: TemplateProcessing "$A <|endoftext|>" (its embedding is the
    # hidden state at that token); on the byte-level default vocabulary, against transformers
    from tokenizers import processors

    tok = hf_default_tokenizer().backend_tokenizer
    eot = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)])
    ours, theirs = _pair(_write(tmp_path / "eos", tok.to_str()))
    for text in ("Hello world", "a", ""):
        assert ours.encode_prompt(text) == theirs(text)["input_ids"]
        assert ours.encode_prompt(text)[-1] == eot and ours.encode(text) == theirs.encode(text, add_special_tokens=False)
    # both ends (a BOS template with an EOS after)
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A <|endoftext|> <|im_end|>",
                                                       special_tokens=[("<|im_start|>", tok.token_to_id("<|im_start|>")),
                                                                       ("<|endoftext|>", eot),
                                                                       ("<|im_end|>", tok.token_to_id("<|im_end|>"))])
    ours, theirs = _pair(_write(tmp_path / "both", tok.to_str()))
    assert ours.encode_prompt("Hello") == theirs("Hello")["input_ids"] and len(ours.encode_prompt("Hello")) == \
        len(ours.encode("Hello")) + 3


def test_chat_template_bos_token_comes_once(tmp_path):
    # a Llama 2-style template writes {{ bos_token }} itself; the rendered chat is encoded without the
    # post-processor's BOS (what the SDK's fill_chat does), so it starts with one BOS, as transformers'
    from tokenizers import processors

    tok = tokenizers.Tokenizer.from_str(_sentencepiece_json("prepend"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    path = _write(tmp_path / "chat", tok.to_str())
    template = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                            "chat_template": template}))
    ours = Tokenizer(hf_tokenizer(path, {}))
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    chat = [{"role": "user", "content": "Hello world"}]
    ids = ours.encode(ours.apply_chat_template(chat))
    want = theirs.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == list(want) and ids.count(1) == 1 and ids[0] == 1


def test_grammar_over_a_sentencepiece_vocabulary(sentencepiece):
    # a grammar's mask over byte-fallback pieces and "▁" words: what it allows spells its language
    from test_grammar import Info, unpack

    from gpu_backend.grammar import GrammarCompiler, Matcher, token_bytes

    ours, _ = sentencepiece
    vocab = ours.vocab_size + 3  # a model vocabulary padded past the tokenizer's
    tb = token_bytes(ours, vocab)
    assert tb[3 + 0x41] == b"A" and tb[-1] == b"" and tb[2] == b"</s>"
    m = Matcher(GrammarCompiler(ours, Info(vocab_size=vocab, stop_tokens=[2]), threads=1).regex(" (the|fox)"))
    allowed = unpack(m.fill_mask())
    assert allowed and all(b" the".startswith(tb[i]) or b" fox".startswith(tb[i]) for i in allowed)
