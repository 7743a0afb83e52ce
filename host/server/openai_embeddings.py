"""`POST /v1/embeddings` (issue 53): the request checked, the embedding handler's vectors as OpenAI's answer.

`parse_embeddings` validates a body into an `EmbeddingRequest` (or raises `OpenAIError` 400 naming the
parameter); `check_inputs` bounds it against the model (token ids inside the vocabulary, each input
within the model's context and the KV pages one request may hold, `dimensions` within the hidden
size). The handler instance (inferlets/openai_embed) gets `handler_argument()`, `{"model", "input":
[string or token ids, ...]}`, and sends `{"index": i, "embedding": [float, ...]}` per input, then
`{"usage": {"prompt_tokens": n}}` (or `{"error": {"message", "param"}}` alone: a 400). `response`
makes OpenAI's answer: `dimensions` keeps the first N values and L2-normalizes them again
(Matryoshka truncation, where the model allows it: `check_inputs`), `encoding_format: "base64"` gives each vector as
the base64 of its little-endian float32 bytes (what the openai client decodes).
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from host.server.openai_errors import bad_param as _bad

__all__ = ["MAX_INPUTS", "EmbeddingRequest", "check_inputs", "parse_embeddings", "response"]

MAX_INPUTS = 2048  # inputs in one request (OpenAI's bound)


@dataclasses.dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[str | tuple[int, ...], ...]
    encoding_format: str = "float"
    dimensions: int | None = None
    priority: int = 0

    def handler_argument(self) -> str:
        """The JSON argument of the embedding handler (docs/openai.md, "Embeddings")."""
        return json.dumps({"model": self.model, "input": [x if isinstance(x, str) else list(x) for x in self.inputs]})


def _is_id(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _inputs(value: Any) -> tuple[str | tuple[int, ...], ...]:
    """A string, an array of strings, an array of token ids (one input) or an array of such arrays."""
    if isinstance(value, str):
        value = [value]
    elif isinstance(value, list) and value and all(_is_id(t) for t in value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise _bad("input", "expected a non-empty string, an array of strings, an array of token ids or an array "
                   f"of token-id arrays, got {str(value)[:100]}")
    if len(value) > MAX_INPUTS:
        raise _bad("input", f"{len(value)} inputs, more than the {MAX_INPUTS} one request may carry")
    out: list[str | tuple[int, ...]] = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            if not x:
                raise _bad("input", f"input {i} is an empty string")
            out.append(x)
        elif isinstance(x, list) and all(_is_id(t) for t in x):
            if not x:
                raise _bad("input", f"input {i} is an empty array of token ids")
            out.append(tuple(x))
        else:
            raise _bad("input", f"input {i} must be a string or an array of token ids, got {str(x)[:100]}")
    kinds = {isinstance(x, str) for x in out}
    if len(kinds) > 1:
        raise _bad("input", "an array of inputs is all strings or all token-id arrays, not both")
    return tuple(out)


def parse_embeddings(body: dict[str, Any]) -> EmbeddingRequest:
    """Validate a /v1/embeddings body (OpenAIError 400 naming the parameter)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"expected a model name, got {model!r}")
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", f"expected float or base64, got {fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and (not _is_id(dims) or dims < 1):
        raise _bad("dimensions", f"expected a positive integer, got {dims!r}")
    from host.levels import PRIORITY_MAX, PRIORITY_MIN

    priority = body.get("priority", 0)
    if priority is None:
        priority = 0
    if not _is_id(priority) or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise _bad("priority", f"expected an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r}")
    return EmbeddingRequest(model, _inputs(body.get("input")), fmt, dims, priority)


def check_inputs(req: EmbeddingRequest, hidden_size: int | None, vocab_size: int | None, max_tokens: int | None,
                 count: Callable[[str], int] | None, matryoshka: tuple[int, ...] | None = None) -> None:
    """OpenAIError 400 when the model cannot embed `req`: it gives no embeddings (`hidden_size` 0),
    `dimensions` past its hidden size or a width it does not allow (`matryoshka`: the widths it was
    trained to be cut to, () any, None none: its full width only), a token id outside the vocabulary,
    an input of more than `max_tokens` tokens (`count` counts a string's, as the handler tokenizes
    it). None: not known (not checked). Tokenizes: run it off the event loop."""
    if hidden_size == 0:
        raise _bad("model", f"the model {req.model!r} gives no embeddings (its backend returns no hidden states)")
    if req.dimensions is not None and hidden_size is not None:
        _check_dimensions(req.model, req.dimensions, hidden_size, matryoshka)
    for i, x in enumerate(req.inputs):
        if isinstance(x, str):
            n = count(x) if count is not None else None
        else:
            n = len(x)
            bad = [t for t in x if t < 0 or (vocab_size is not None and t >= vocab_size)]
            if bad:
                raise _bad("input", f"input {i}: token id {bad[0]} is outside the vocabulary (size {vocab_size})")
        if n is not None and max_tokens and n > max_tokens:
            raise _bad("input", f"input {i} is {n} tokens, more than the {max_tokens} the model can embed at once; "
                       "shorten it")


def _check_dimensions(model: str, dims: int, hidden_size: int, matryoshka: tuple[int, ...] | None) -> None:
    if dims > hidden_size:
        raise _bad("dimensions", f"{dims} is more than the model's {hidden_size} dimensions")
    if dims == hidden_size:
        return
    if matryoshka is None:
        raise _bad("dimensions", f"the model {model!r} does not allow dimensions={dims}: its config.json declares no "
                   f"Matryoshka representation (is_matryoshka / matryoshka_dimensions), so its embeddings are "
                   f"{hidden_size} wide; leave dimensions out, or start pie-serve with --matryoshka if the model was "
                   "trained for it")
    if matryoshka and dims not in matryoshka:
        raise _bad("dimensions", f"the model {model!r} allows dimensions {', '.join(map(str, matryoshka))} or "
                   f"{hidden_size}, not {dims}")


def response(req: EmbeddingRequest, vectors: dict[int, list[float]], prompt_tokens: int) -> dict[str, Any]:
    """OpenAI's answer: {object: list, data: [{object: embedding, index, embedding}], model, usage}."""
    data = []
    for i in range(len(req.inputs)):
        v = np.asarray(vectors[i], dtype=np.float32)
        if req.dimensions is not None:
            if req.dimensions > len(v):
                raise _bad("dimensions", f"{req.dimensions} is more than the model's {len(v)} dimensions")
            if req.dimensions < len(v):  # (all of them: the vector as it is)
                w = v[: req.dimensions].astype(np.float64)
                norm = float(np.linalg.norm(w))
                v = (w / norm if norm > 0 else w).astype(np.float32)
        emb: Any = (base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
                    else v.astype(np.float32).tolist())
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return {"object": "list", "data": data, "model": req.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
