"""openai_chat: the standard handler of the OpenAI endpoint (issue 14).

Argument: one JSON object, the server's validated request (`messages` or `prompt`,
`max_tokens`, sampling fields, `stop`, `n`, `seed`, `stream`, `response_format`).
Messages sent to the client, one JSON object each:
  {"index": i, "delta": text}                               while streaming;
  {"index": i, "text": t, "finish_reason": "stop"|"length", "completion_tokens": k} per choice;
  {"usage": {"prompt_tokens": p, "completion_tokens": c}}    last.
Choices after the first are forks of the prompt's context, so they share its full KV pages.
Stop strings are matched on the decoded text (across token boundaries) and left out; while
streaming, a tail that could still begin a stop string is held back until it cannot.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from inferlet import (
    AnyOf,
    Context,
    Grammar,
    InferletError,
    Sampler,
    Stop,
    UntilText,
    UntilTokens,
    any_json,
    get_model,
    json_schema,
    send,
)


def _grammar(fmt: dict[str, Any] | None) -> Grammar | None:
    if fmt is None:
        return None
    return any_json() if fmt["type"] == "json_object" else json_schema(fmt["schema"])


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class _Streamer:
    """Sends deltas of one choice, holding back a tail that may begin a stop string."""

    def __init__(self, index: int, stops: list[str]) -> None:
        self.index, self.stops, self.text, self.sent = index, stops, "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def __call__(self, piece: str) -> None:
        self.text += piece
        visible, _ = _cut(self.text, self.stops)
        self.flush(len(visible) if len(visible) < len(self.text) else len(visible) - self.hold)

    def flush(self, upto: int) -> None:
        if upto > self.sent:
            send(json.dumps({"index": self.index, "delta": self.text[self.sent:upto]}))
            self.sent = upto


def _choice(ctx: Context, req: dict[str, Any], index: int, stop: Stop) -> int:
    seed = req.get("seed")
    sampler = Sampler(req.get("temperature", 1.0), req.get("top_k", 0), req.get("top_p", 1.0),
                      req.get("min_p", 0.0), None if seed is None else seed + 7919 * index)
    stops = list(req.get("stop") or [])
    streamer = _Streamer(index, stops) if req.get("stream") else None
    before = len(ctx.tokens)
    on_text: Callable[[str], None] | None = streamer
    text = ctx.generate(sampler, stop=stop, max_tokens=req["max_tokens"], on_text=on_text,
                        grammar=_grammar(req.get("response_format")))
    generated = len(ctx.tokens) - before
    text, stopped = _cut(text, stops)
    if streamer is not None:
        streamer.text = text
        streamer.flush(len(text))
    reason = "length" if not stopped and generated >= req["max_tokens"] else "stop"
    send(json.dumps({"index": index, "text": text, "finish_reason": reason,
                     "completion_tokens": generated}))
    return generated


def main(args: list[str]) -> None:
    if len(args) != 1:
        raise InferletError(f"openai_chat takes one JSON request argument, got {len(args)}")
    req = json.loads(args[0])
    model = get_model()
    with Context(model) as ctx:
        if req.get("messages") is not None:
            ctx.fill_chat(req["messages"], add_generation_prompt=True)
        else:
            ctx.fill(req["prompt"])
        prompt_tokens = len(ctx.tokens)
        stop: Stop = AnyOf(UntilTokens(model.stop_tokens), *(UntilText(s) for s in req.get("stop") or []))
        if req.get("n", 1) > 1:
            ctx.flush()  # prefill once: the forks then share the prompt's full pages
        forks = [ctx.fork() for _ in range(req.get("n", 1) - 1)]
        total = 0
        for i, c in enumerate([ctx, *forks]):
            total += _choice(c, req, i, stop)
            if c is not ctx:
                c.release()
    send(json.dumps({"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": total}}))
