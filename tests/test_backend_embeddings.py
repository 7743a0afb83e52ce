"""Hidden states out (`OutputSpec.hidden`) and embeddings in (`ForwardRequest.embeds`), against
transformers on the same random weights: Qwen3 (the shape of Qwen3-Embedding, whose embedding is the
last token's normed hidden state) and Gemma 3 text (an embedding scale, which input vectors replace
the result of). Also the stand-in backend's and the engine wire's handling of both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import hf_default_tokenizer

from gpu_backend.build import backend_from_weights, make_attention
from gpu_backend.engine.wire import decode_requests, decode_results, encode_requests, encode_results
from gpu_backend.loading.loader import load_model_files
from gpu_backend.standin import StandInBackend
from gpu_backend.types import ForwardError, ForwardRequest, OutputResult, OutputSpec, SamplerParams

transformers = pytest.importorskip("transformers")
TOL = 1e-4


def _common() -> dict[str, object]:
    return dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)


# gemma3_text is heavy (~4 s of a second transformers model built and run; make test runs it)
@pytest.fixture(scope="module", params=["qwen3", pytest.param("gemma3_text", marks=pytest.mark.heavy)])
def pair(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    if request.param == "qwen3":
        cfg = transformers.Qwen3Config(**_common(), head_dim=32, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(cfg)
    else:
        cfg = transformers.Gemma3TextConfig(**_common(), head_dim=16, query_pre_attn_scalar=24, sliding_window=64,
                                            attn_implementation="eager")
        model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    out = tmp_path_factory.mktemp("emb") / request.param
    model.save_pretrained(out)
    hf_default_tokenizer().save_pretrained(out)
    files = load_model_files(Path(out), progress=False)
    ours = backend_from_weights(files.config, files.weights, files.tokenizer, files.name, device=torch.device("cpu"),
                                dtype=torch.float32, page_size=4, num_pages=64, attention=make_attention("sdpa"))
    return ours, model.float().eval()


def _request(ids: list[int], pages: list[int], outputs: list[OutputSpec], embeds=None) -> ForwardRequest:  # type: ignore[no-untyped-def]
    n = len(ids)
    return ForwardRequest(pages=pages[: -(-n // 4)], last_page_len=n - (-(-n // 4) - 1) * 4, tokens=ids,
                          positions=list(range(n)), outputs=outputs, embeds=embeds)


IDS = [1, 450, 4996, 17354, 1701, 432, 3382, 21, 9, 77, 12]


def test_hidden_states_equal_transformers_last_hidden_state(pair) -> None:  # type: ignore[no-untyped-def]
    ours, model = pair
    res = ours.forward([_request(IDS, list(range(8)), [OutputSpec(index=i, hidden=True) for i in range(len(IDS))])])
    got = np.stack([np.frombuffer(r.hidden, dtype="<f4") for r in res[0]])
    with torch.no_grad():
        ref = model.model(torch.tensor([IDS])).last_hidden_state[0].numpy()
    assert got.shape == ref.shape == (len(IDS), 64)
    np.testing.assert_allclose(got, ref, atol=TOL, rtol=1e-4)
    # last-token pooling, L2-normalized (Qwen3-Embedding's), and mean pooling
    last = got[-1] / np.linalg.norm(got[-1])
    np.testing.assert_allclose(last, ref[-1] / np.linalg.norm(ref[-1]), atol=TOL)
    np.testing.assert_allclose(got.mean(0), ref.mean(0), atol=TOL)


def test_input_vectors_equal_transformers_inputs_embeds(pair) -> None:  # type: ignore[no-untyped-def]
    ours, model = pair
    rng = np.random.default_rng(0)
    vecs = rng.standard_normal((3, 64)).astype("<f4")
    embeds = [(2, vecs[:2].tobytes()), (6, vecs[2:].tobytes())]  # two runs, placeholders under them
    out = [OutputSpec(index=len(IDS) - 1, sample=SamplerParams(), dist=5)]
    got = ours.logits([_request(IDS, list(range(8, 16)), out, embeds)])[0][0]
    with torch.no_grad():
        x = model.get_input_embeddings()(torch.tensor([IDS]))  # (Gemma's scale is applied in this module)
        x[0, 2:4] = torch.from_numpy(vecs[:2])
        x[0, 6] = torch.from_numpy(vecs[2])
        ref = model(inputs_embeds=x).logits[0, -1]
    torch.testing.assert_close(got, ref.float(), atol=TOL, rtol=1e-4)
    plain = ours.logits([_request(IDS, list(range(16, 24)), out)])[0][0]
    assert (plain - got).abs().max() > 1e-3  # the vectors changed the answer


def test_the_embedding_of_a_token_as_a_vector_changes_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    ours, model = pair
    with torch.no_grad():
        table = model.get_input_embeddings()(torch.tensor([IDS[4]]))[0].numpy().astype("<f4")
    out = [OutputSpec(index=len(IDS) - 1, hidden=True)]
    a = ours.forward([_request(IDS, list(range(24, 32)), out, [(4, table.tobytes())])])[0][0].hidden
    b = ours.forward([_request(IDS, list(range(32, 40)), out)])[0][0].hidden
    np.testing.assert_allclose(np.frombuffer(a, "<f4"), np.frombuffer(b, "<f4"), atol=1e-5)


@pytest.mark.parametrize(("embeds", "match"), [
    ([(0, b"\0" * 12)], "not a whole number"),
    ([(10, b"\0" * 256 * 2)], "passes the 11 new tokens"),
    ([(0, b"\0" * 256), (0, b"\0" * 256)], "overlaps"),
    ([(0, "x")], "must be \\(index, bytes\\)"),
])
def test_bad_input_vectors_are_refused(pair, embeds, match) -> None:  # type: ignore[no-untyped-def]
    ours, _ = pair
    with pytest.raises(ForwardError, match=match):
        ours.forward([_request(IDS, list(range(40, 48)), [OutputSpec(index=0)], embeds)])


def test_standin_and_wire_carry_both() -> None:
    be = StandInBackend(page_size=4, num_pages=8)
    vec = np.asarray([65.0, 0, 0, 0], dtype="<f4").tobytes()  # acts as token 65
    r = ForwardRequest(pages=[0], last_page_len=3, tokens=[10, 0, 30], positions=[0, 1, 2], embeds=[(1, vec)],
                       outputs=[OutputSpec(index=1, sample=SamplerParams(), hidden=True), OutputSpec(index=2, hidden=True)])
    out = be.forward([r])[0]
    assert out[0].token == 66
    assert np.frombuffer(out[0].hidden, "<f4").tolist() == [65.0, 1.0, 75.0, 1.0]
    assert np.frombuffer(out[1].hidden, "<f4").tolist() == [30.0, 2.0, 105.0, 1.0]
    back = decode_requests(encode_requests([r]))[0]
    assert back.embeds == r.embeds and [o.hidden for o in back.outputs] == [True, True]
    assert decode_results(encode_results([out]))[0][0].hidden == out[0].hidden
    assert decode_results(encode_results([[OutputResult(token=3)]]))[0][0].hidden is None


@pytest.mark.parametrize("tied", [True, False])
def test_a_qwen3_embedding_checkpoint_pools_as_transformers(tmp_path, tied) -> None:  # type: ignore[no-untyped-def]
    # Qwen3-Embedding ships the base model (transformers' Qwen3Model: `embed_tokens.weight`, `layers.N.*`,
    # `norm.weight`, no `model.` prefix, no LM head; the 8B's config says untied). Its embedding is the
    # last token's final-norm hidden state, L2-normalized: through the host's `embed.hidden` (pooling
    # last and mean, normalized or not) against transformers' `Qwen3Model` on the same random weights.
    from wasmtime.component import Record

    from host import Host, HostConfig
    from host.api import import_tables
    from host.wasm.calling import calling
    from host.wasm.instance import Instance

    torch.manual_seed(1)
    # (the tied one declares Matryoshka widths, as a config.json may: they reach the backend's info)
    extra = dict(matryoshka_dimensions=[16, 32]) if tied else {}
    cfg = transformers.Qwen3Config(**_common(), head_dim=32, tie_word_embeddings=tied, architectures=["Qwen3Model"],
                                   **extra)
    model = transformers.Qwen3Model(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(tmp_path / "q3e")
    from tokenizers import processors

    tok = hf_default_tokenizer()  # with Qwen3-Embedding's post-processor: the text, then <|endoftext|>
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", eot)])
    tok.save_pretrained(tmp_path / "q3e")
    files = load_model_files(tmp_path / "q3e", progress=False)
    assert "embed_tokens.weight" not in files.weights and files.config.tie_embeddings
    ours = backend_from_weights(files.config, files.weights, files.tokenizer, files.name, device=torch.device("cpu"),
                                dtype=torch.float32, page_size=4, num_pages=64, attention=make_attention("sdpa"))
    assert ours.info.matryoshka == ([16, 32] if tied else None)
    # a text as the embedding handler tokenizes it (`encode_prompt`) = transformers' tokenizer(text)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "q3e")("The capital of France is Paris.")
    ids = ours.tokenizer.encode_prompt("The capital of France is Paris.")
    assert ids == theirs["input_ids"] and ids[-1] == eot and 4 <= len(ids) <= 12
    with torch.no_grad():
        ref = model.eval()(torch.tensor([ids])).last_hidden_state[0].numpy()
    assert np.abs(ref[-1]).max() > 0.1  # not vanishing: the tolerance means something

    class Pooling(Record):
        pass

    with Host(HostConfig(data_dir=tmp_path / "h"), backend=ours) as host:
        flat = import_tables(host.services)
        inst = Instance(host._env, "0" * 64, [], lambda ev: None)
        calling.instance = inst
        try:
            for pooling, normalize in (("last", True), ("last", False), ("mean", True), ("mean", False)):
                pages = flat["kv"]["allocate"](None, -(-len(ids) // 4))
                p = Pooling()
                p.name = pooling
                got = np.asarray(flat["embed"]["hidden"](None, pages, len(ids) - 4 * (-(-len(ids) // 4) - 1), ids,
                                                         list(range(len(ids))), [], p, normalize))
                want = ref[-1] if pooling == "last" else ref.mean(0)
                want = want / np.linalg.norm(want) if normalize else want
                assert got.shape == (64,)
                np.testing.assert_allclose(got, want, atol=TOL, rtol=1e-4, err_msg=f"{pooling} {normalize}")
                flat["kv"]["release"](None, pages)
        finally:
            calling.instance = None
            host._instance_ended(inst)


def test_matryoshka_widths_from_config_json() -> None:
    # vLLM's names: `matryoshka_dimensions` (those widths) or `is_matryoshka` (any); neither: full width only
    from gpu_backend.loading.hf_dir import _hf_config

    raw = dict(model_type="qwen3", **_common(), head_dim=32)
    assert _hf_config(raw).matryoshka is None
    assert _hf_config({**raw, "is_matryoshka": True}).matryoshka == ()
    assert _hf_config({**raw, "matryoshka_dimensions": [32, 16, 32]}).matryoshka == (16, 32)
    with pytest.raises(ValueError, match=r"matryoshka_dimensions must be a list of widths in \[1, 64\]"):
        _hf_config({**raw, "matryoshka_dimensions": [128]})
    cfg = _hf_config({**raw, "matryoshka_dimensions": [16]})
    assert type(cfg).from_dict(cfg.to_dict()) == cfg  # (the engine wire's round trip)
