"""parallel_generation: N answers from one shared prompt, the prompt prefilled once.

The prompt is prefilled once into a root context; each of the N branches is a `Context.fork()`
sharing its full KV pages (the partial last page is copied). All branches decode at once: each
step submits one pass per live branch and the host batches them. Branch i samples with seed
`--seed + i`, so the answers differ and runs are reproducible.

Returns the answers separated by blank lines; with --json {"answers", "prompt_tokens",
"generated_tokens", "forwarded_tokens"} where forwarded_tokens counts every token this instance
sent through a forward pass.
"""

from __future__ import annotations

import json

from inferlet import ArgumentParser, Context, InferletError, Sampler, get_model, wait_any


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="parallel_generation", description="N sampled answers to one prompt, decoded together.")  # fmt: skip
    p.add_argument("-p", "--prompt", default="Give me a name for a pet cat.", help="the user prompt")
    p.add_argument("-N", "--num", type=int, default=4, help="number of answers (4)")
    p.add_argument("-n", "--max-tokens", type=int, default=24, help="most tokens per answer (24)")
    p.add_argument("-t", "--temperature", type=float, default=0.8, help="sampling temperature (0.8)")
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus threshold (0.95)")
    p.add_argument("--seed", type=int, default=0, help="branch i samples with seed + i (0)")
    p.add_argument("--json", action="store_true", help="return a JSON object with token counts")
    return p


PARSER = parser()


def main(args: list[str]) -> str | None:
    p = PARSER
    opts = p.parse(args)
    if opts.num < 1 or opts.max_tokens < 1:
        raise InferletError("--num and --max-tokens must be >= 1")
    try:
        base = Sampler(opts.temperature, 0, opts.top_p, 0.0, opts.seed)
    except ValueError as e:
        raise InferletError(str(e)) from None
    model = get_model()
    stops = set(model.stop_tokens)
    root = Context(model)
    root.fill_user(opts.prompt)
    prompt_tokens = len(root.tokens)
    root.flush()  # the shared prefix, prefilled once (all but the last token)
    forwarded = prompt_tokens - 1
    branches = [root.fork() for _ in range(opts.num - 1)] + [root]
    out: list[list[int]] = [[] for _ in branches]
    live: dict[int, object] = {}
    try:
        for i, ctx in enumerate(branches):
            live[i] = ctx.submit_decode(base.with_seed(opts.seed + i * 1_000_003))
            forwarded += 1
        while live:
            done = wait_any(list(live.values()))  # type: ignore[arg-type]
            i = next(k for k, f in live.items() if f is done)
            tok = done.result
            out[i].append(tok)
            if tok in stops or len(out[i]) >= opts.max_tokens:
                del live[i]
                continue
            live[i] = branches[i].submit_decode(base.with_seed(opts.seed + i * 1_000_003 + len(out[i])))
            forwarded += 1
    finally:
        for ctx in branches:
            ctx.release()
    answers = [model.decode([t for t in toks if t not in stops]) for toks in out]
    if opts.json:
        return json.dumps(
            {
                "answers": answers,
                "prompt_tokens": prompt_tokens,
                "generated_tokens": [len(t) for t in out],
                "forwarded_tokens": forwarded,
            }
        )
    return "\n\n".join(f"[{i}] {a}" for i, a in enumerate(answers))
