"""openai_embed: the standard handler of the OpenAI endpoint's `POST /v1/embeddings` (issue 53).

Argument: one JSON object, the server's validated request: {"model", "input": [item, ...]}, each
item a string or an array of token ids (the server has checked them: none empty, ids inside the
vocabulary, none longer than the model's context). Each item becomes one vector: a string is
tokenized as transformers' `tokenizer(text)` does (`Model.encode_prompt`: BOS first where the
tokenizer adds one), token ids are taken as they are; one pass over fresh pages returns the last
token's hidden state after the model's final norm, L2-normalized (`embed.embed_tokens(tokens,
"last")`): last-token pooling, as decoder embedding models such as Qwen3-Embedding are used.
Messages sent, one JSON object each:
  {"index": i, "embedding": [float, ...]}       per item, in order;
  {"usage": {"prompt_tokens": n}}               last (n: the tokens embedded);
  {"error": {"message", "param"}}               alone: the request cannot be served (a 400).
The server truncates to `dimensions` and encodes (float or base64) itself (host/server/openai_embeddings.py).
"""

from __future__ import annotations

import json

from inferlet import InferletError, embed, get_model, send
from inferlet.warmup import warm_up

POOLING = "last"


def main(args: list[str]) -> None:
    if len(args) != 1:
        raise InferletError(f"openai_embed takes one JSON request argument, got {len(args)}")
    req = json.loads(args[0])
    model = get_model()
    items = req["input"]
    if not embed.hidden_size():
        send(json.dumps({"error": {"message": f"model: the model {model.name} gives no embeddings", "param": "model"}}))
        return
    tokens = [model.encode_prompt(x) if isinstance(x, str) else [int(t) for t in x] for x in items]
    for i, ids in enumerate(tokens):
        bad = [t for t in ids if not 0 <= t < model.vocab_size]
        if not ids or bad:
            why = "no tokens" if not ids else f"token id {bad[0]} is outside the vocabulary (size {model.vocab_size})"
            send(json.dumps({"error": {"message": f"input: input {i}: {why}", "param": "input"}}))
            return
    total = 0
    for i, ids in enumerate(tokens):
        send(json.dumps({"index": i, "embedding": embed.embed_tokens(ids, POOLING, normalize=True)}))
        total += len(ids)
    send(json.dumps({"usage": {"prompt_tokens": total}}))


# (the start path runs once while pie-build snapshots the guest: inferlet/warmup.py)
warm_up(main, ['{"model": "warm-up", "input": ["Hello there", [3, 4, 5]]}'])
