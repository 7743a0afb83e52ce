"""retrieval: embed documents, pick the nearest to a question, answer from it: RAG in one inferlet.

    pie-run retrieval -- --doc "Paris is the capital of France." --doc "Berlin is in Germany." \\
        --question "What is the capital of France?"

Each document and the question become one vector (`embed.embed_tokens`: the last token's hidden
state, L2-normalized; a decoder embedding model such as Qwen3-Embedding gives good ones, any model
gives some); the documents are ranked by cosine similarity, and the best `--top` go into the prompt
the answer is generated from, in a fresh context. Nothing leaves the server between the steps.
Returns the answer; with --json {"answer", "ranking": [{"doc", "score"}]}.
"""

from __future__ import annotations

import json

from inferlet import ArgumentParser, Context, InferletError, Sampler, embed, get_model
from inferlet.sampler import AnyOf, MaxTokens, UntilTokens

DEFAULT_DOCS = [
    "Paris is the capital and largest city of France.",
    "The Great Wall of China is thousands of kilometres long.",
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
]


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="retrieval", description="Embed documents, retrieve the nearest, answer from it.")
    p.add_argument("--doc", action="append", default=None, help="a document (repeatable)")
    p.add_argument("--question", default="What is the capital of France?")
    p.add_argument("--top", type=int, default=1, help="documents put in the prompt (1)")
    p.add_argument("--pooling", default="last", choices=["last", "mean"])
    p.add_argument("-n", "--max-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true")
    return p


PARSER = parser()


def main(args: list[str]) -> str | None:
    opts = PARSER.parse(args)
    docs = opts.doc or DEFAULT_DOCS
    if opts.top < 1:
        raise InferletError("--top must be >= 1")
    model = get_model()
    q = embed.embed_tokens(model.encode(opts.question), opts.pooling)
    scored = []
    for d in docs:
        v = embed.embed_tokens(model.encode(d), opts.pooling)
        scored.append((sum(a * b for a, b in zip(q, v, strict=True)), d))
    scored.sort(key=lambda s: -s[0])
    context = "\n".join(d for _s, d in scored[: opts.top])
    with Context(model) as ctx:
        ctx.fill_chat([{"role": "system", "content": f"Answer from this text:\n{context}"},
                       {"role": "user", "content": opts.question}])
        stop = AnyOf(MaxTokens(opts.max_tokens), UntilTokens(model.stop_tokens))
        answer = ctx.generate(Sampler.greedy(), stop=stop).strip()
    if opts.json:
        return json.dumps({"answer": answer, "ranking": [{"doc": d, "score": s} for s, d in scored]})
    return answer
