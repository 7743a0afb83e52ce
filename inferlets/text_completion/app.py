"""text_completion: answer one prompt with the model's chat template (or raw), like `generate`.

Returns the generated text as the instance's return value. With `--stream`, the text is also
sent to the client piece by piece as it is produced.
"""

from __future__ import annotations

from inferlet import ArgumentParser, Context, InferletError, Sampler, get_model, send
from inferlet.warmup import warm_up

DEFAULT_PROMPT = "What is the capital of France?"


def parser() -> ArgumentParser:
    p = ArgumentParser(prog="text_completion", description="Complete one prompt; the text is the return value.")  # fmt: skip
    p.add_argument("-p", "--prompt", default=DEFAULT_PROMPT, help=f"the user prompt (default: {DEFAULT_PROMPT!r})")
    p.add_argument("--system", default=None, help="a system message (default: the template's own)")
    p.add_argument("-n", "--max-tokens", type=int, default=128, help="most tokens to generate (128)")
    p.add_argument("-t", "--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most probable (0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filter (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    p.add_argument("--raw", action="store_true", help="feed the prompt as is, without the chat template")
    p.add_argument("--stream", action="store_true", help="also send text pieces as they are generated")
    return p


# Built at import, i.e. while pie-build pre-initializes the component: argparse pulls in gettext
# and locale, and only modules imported at build time are in the component's snapshot.
PARSER = parser()


def main(args: list[str]) -> str | None:
    p = PARSER
    opts = p.parse(args)
    if not opts.prompt:
        raise InferletError(f"--prompt must not be empty\n{p.format_usage().rstrip()}")
    if opts.max_tokens < 1:
        raise InferletError(f"--max-tokens must be >= 1, got {opts.max_tokens}")
    try:
        sampler = Sampler(opts.temperature, opts.top_k, opts.top_p, opts.min_p, opts.seed)
    except ValueError as e:
        raise InferletError(str(e)) from None
    model = get_model()
    with Context(model) as ctx:
        if opts.raw:
            ctx.fill_prompt(opts.prompt)  # BOS where the tokenizer adds one, as transformers' tokenizer(text)
        else:
            if not model.chat_template:
                raise InferletError(f"model {model.name!r} has no chat template (a base model?): use --raw to "
                                    "complete the prompt as it is")
            messages = [{"role": "system", "content": opts.system}] if opts.system is not None else []
            messages.append({"role": "user", "content": opts.prompt})
            ctx.fill_chat(messages, add_generation_prompt=True)
        return ctx.generate(sampler, max_tokens=opts.max_tokens, on_text=send if opts.stream else None)


# Run main's path while pie-build snapshots the component, against a stand-in host in the guest:
# every instance then starts with that code already specialized by CPython (inferlet/warmup.py).
warm_up(main, [], ["--prompt", "Hello", "--max-tokens", "16"])
