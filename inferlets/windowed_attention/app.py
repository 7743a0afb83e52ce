"""windowed_attention: attention sink + sliding window, for long generation in bounded KV memory.

After every decode step the tokens between the first --sink tokens and the last --window tokens
are masked from attention (`Context.mask_token_range`), and full pages whose tokens are all masked
go back to the host (`Context.drop_masked_pages`). So the context holds the sink's page, about
window / page_size pages and one partial page, however long the output (positions keep counting).

Returns the text; with --json {"text", "tokens", "max_pages", "pages_per_step"}.
"""

from __future__ import annotations

import json

from inferlet import PAGES, ArgumentParser, Context, InferletError, Sampler, get_model, send


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="windowed_attention", description="Long generation with an attention sink and a sliding window.")  # fmt: skip
    p.add_argument("-p", "--prompt", default="Tell me a long story about a dragon who learns to cook.")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="tokens to generate (128)")
    p.add_argument("--sink", type=int, default=4, help="first tokens always attended (4)")
    p.add_argument("--window", type=int, default=64, help="most recent tokens attended (64)")
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--ignore-stop", action="store_true", help="keep going past stop tokens")
    p.add_argument("--stream", action="store_true", help="send text pieces as they are generated")
    p.add_argument("--json", action="store_true", help="return a JSON object with page counts")
    return p


PARSER = parser()


def main(args: list[str]) -> str | None:
    p = PARSER
    opts = p.parse(args)
    if opts.max_tokens < 1 or opts.sink < 0 or opts.window < 1:
        raise InferletError("--max-tokens and --window must be >= 1, --sink >= 0")
    try:
        sampler = Sampler(opts.temperature, 0, 1.0, 0.0, opts.seed)
    except ValueError as e:
        raise InferletError(str(e)) from None
    model = get_model()
    stops = set(model.stop_tokens)
    out: list[int] = []
    pages_per_step: list[int] = []
    sent = 0
    with Context(model) as ctx:
        ctx.fill_user(opts.prompt)
        ctx.flush()
        while len(out) < opts.max_tokens:
            step = sampler if sampler.seed is None else sampler.with_seed(sampler.seed + len(out))
            tok = ctx.decode_step(step)
            pages_per_step.append(len(ctx.pages))
            if tok in stops and not opts.ignore_stop:
                break
            out.append(tok)
            n = len(ctx.tokens)
            if n - opts.sink > opts.window:
                ctx.mask_token_range(opts.sink, n - opts.window)
                ctx.drop_masked_pages()
            if opts.stream and len(out) % 16 == 0:
                text = model.decode(out)
                send(text[sent:])
                sent = len(text)
    text = model.decode([t for t in out if t not in stops])
    if opts.stream and len(text) > sent:
        send(text[sent:])
    if opts.json:
        return json.dumps(
            {
                "text": text,
                "tokens": len(out),
                "max_pages": max(pages_per_step, default=0),
                "pages_per_step": pages_per_step,
                "held_at_end": PAGES.held(),
            }
        )
    return text
