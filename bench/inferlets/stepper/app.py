"""Bench guest for bench/host_scale.py: drives every token itself with `decode-step`, as beam search
and custom samplers do. Args: N PROMPT [--hold]. With --hold it waits for one client message after
the prompt is in the cache (so the bench can count the memory of many live instances)."""

from __future__ import annotations

from inferlet import Context, Sampler, receive


def main(args: list[str]) -> str:
    n, prompt = int(args[0]), args[1]
    greedy = Sampler.greedy()
    with Context() as ctx:
        ctx.fill(prompt)
        if "--hold" in args:
            ctx.flush()
            receive()
        tokens = [ctx.decode_step(greedy) for _ in range(n)]
    return " ".join(map(str, tokens))
