"""openai_chat: the standard handler of the OpenAI endpoint (issue 14).

Argument: one JSON object, the server's validated request (`messages` or `prompt`,
`max_tokens`, sampling fields, `stop`, `n`, `seed`, `stream`, `logprobs`, `top_logprobs`,
`response_format`). Messages sent to the client, one JSON object each:
  {"index": i, "delta": text[, "logprobs": [entry, ...]]}   while streaming;
  {"index": i, "text": t, "finish_reason": "stop"|"length", "completion_tokens": k
   [, "logprobs": [entry, ...]]}                              per choice;
  {"usage": {"prompt_tokens": p, "completion_tokens": c}}    last.
With `logprobs`, an entry per generated token (the stop token and tokens past a stop string left
out): {"token": its text, "logprob": ln p, "bytes": its UTF-8 bytes, "text_offset": where its text
starts in the choice's text, "top_logprobs": [{"token", "logprob", "bytes"}, ...]}; a delta carries
the entries of the tokens whose text starts in what has been sent so far.
Choices after the first are forks of the prompt's context, so they share its full KV pages.
Stop strings are matched on the decoded text (across token boundaries) and left out; while
streaming, a tail that could still begin a stop string is held back until it cannot.

Without logprobs a choice is one host-side generation loop (`Context.generate`). With them the
handler steps token by token, each pass drawing the token with the request's sampler and returning
the LOOKUP_K most probable tokens with their probabilities: the model's own distribution at
temperature 1, before top-k/top-p/min-p (with `response_format`, over the tokens the grammar
allows). A drawn token outside those LOOKUP_K gets logprob -9999.0, OpenAI's value for "very
unlikely". With a seed both paths draw the same tokens (step i uses seed + i).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from inferlet import (
    AnyOf,
    Context,
    Grammar,
    GrammarError,
    InferletError,
    Matcher,
    Model,
    Sampler,
    Stop,
    UntilText,
    UntilTokens,
    _host,
    any_json,
    get_model,
    json_schema,
    send,
)
from inferlet.warmup import warm_up

LOOKUP_K = 20  # probabilities returned per step: the drawn token's logprob is exact when among them
VERY_UNLIKELY = -9999.0  # OpenAI's logprob for a token outside the top 20


def _grammar(fmt: dict[str, Any] | None) -> Grammar | None:
    if fmt is None:
        return None
    return any_json() if fmt["type"] == "json_object" else json_schema(fmt["schema"])


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class _Streamer:
    """Sends deltas of one choice, holding back a tail that may begin a stop string.

    With `entries` (logprobs), each delta carries the entries whose text starts before its end."""

    def __init__(self, index: int, stops: list[str], entries: list[dict[str, Any]] | None = None) -> None:
        self.index, self.stops, self.text, self.sent = index, stops, "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.entries, self.entries_sent = entries, 0

    def __call__(self, piece: str) -> None:
        self.text += piece
        visible, _ = _cut(self.text, self.stops)
        self.flush(len(visible) if len(visible) < len(self.text) else len(visible) - self.hold)

    def flush(self, upto: int) -> None:
        if upto > self.sent:
            msg: dict[str, Any] = {"index": self.index, "delta": self.text[self.sent:upto]}
            if self.entries is not None:
                n = self.entries_sent
                while n < len(self.entries) and self.entries[n]["text_offset"] < upto:
                    n += 1
                msg["logprobs"] = self.entries[self.entries_sent:n]
                self.entries_sent = n
            send(json.dumps(msg))
            self.sent = upto


class _Pieces:
    """Token strings (cached) for the top_logprobs lists."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        if token not in self.cache:
            self.cache[token] = self.model.decode([token])
        return self.cache[token]


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else VERY_UNLIKELY


def _entry(piece: str, token: int, offset: int, top_ids: list[int], top_probs: list[float], top_n: int,
           pieces: _Pieces) -> dict[str, Any]:
    """The logprobs entry of a drawn token whose text is `piece`, at `offset` in the choice's text."""
    probs = dict(zip(top_ids, top_probs, strict=True))
    top = []
    for i, p in zip(top_ids[:top_n], top_probs[:top_n], strict=True):
        t = piece if i == token else pieces(i)
        top.append({"token": t, "logprob": _logprob(p), "bytes": list(t.encode())})
    return {"token": piece, "logprob": _logprob(probs.get(token, 0.0)), "bytes": list(piece.encode()),
            "text_offset": offset, "top_logprobs": top}


def _step(ctx: Context, sampler: Sampler, matcher: Matcher | None) -> tuple[int, list[int], list[float]]:
    """Run the pending tokens, draw the next one with `sampler` (from what `matcher` allows) and
    return it with the LOOKUP_K most probable tokens and their probabilities (one forward pass).

    The SDK's decode_step and next_dist ask for one or the other; this asks for both in one
    output spec (docs/wit.md, forward.output-spec)."""
    spec = ctx._spec(sampler, LOOKUP_K)
    geometry = ctx._prepare_all("decode_step")
    if matcher is None:
        out = _host.forward.run(*geometry, [spec])[0]
    else:
        try:
            out = _host.forward.run_constrained(*geometry, [spec], 0, matcher.handle)[0]
        except _host.Err as e:
            raise GrammarError(str(e.value)) from None
    ctx._append_pending([out.token])
    return out.token, list(out.ids), list(out.probs)


def _choice_logprobs(ctx: Context, req: dict[str, Any], index: int, sampler: Sampler,
                     stop_tokens: set[int], pieces: _Pieces) -> tuple[str, bool, int, list[dict[str, Any]]]:
    """Generate one choice token by token with logprobs: (text before any stop string, whether one
    was found or a stop token drawn, tokens drawn, the entries of the tokens in the text)."""
    model, stops, top_n = ctx.model, list(req.get("stop") or []), int(req.get("top_logprobs") or 0)
    grammar = _grammar(req.get("response_format"))
    matcher = grammar.matcher() if grammar is not None else None
    entries: list[dict[str, Any]] = []
    streamer = _Streamer(index, stops, entries) if req.get("stream") else None
    ids: list[int] = []
    text, stopped, seed = "", False, sampler.seed
    while len(ids) < req["max_tokens"]:
        token, top_ids, top_probs = _step(ctx, sampler if seed is None else sampler.with_seed(seed + len(ids)),
                                          matcher)
        ids.append(token)
        if token in stop_tokens:
            stopped = True
            break
        grown = model.decode(ids)
        piece = grown[len(text):]
        entries.append(_entry(piece, token, len(text), top_ids, top_probs, top_n, pieces))
        text = grown
        if streamer is not None:
            streamer(piece)
        if _cut(text, stops)[1]:
            stopped = True
            break
    text, _ = _cut(text, stops)
    entries[:] = [e for e in entries if e["text_offset"] < len(text)]  # tokens cut with a stop string
    if streamer is not None:
        streamer.text = text
        streamer.flush(len(text))
    return text, stopped, len(ids), entries


def _sampler(req: dict[str, Any], index: int) -> Sampler:
    """Choice `index`'s sampler; top_p 0 (allowed by OpenAI) keeps only the most probable token."""
    seed = req.get("seed")
    temperature, top_p = req.get("temperature", 1.0), req.get("top_p", 1.0)
    if top_p <= 0:
        temperature, top_p = 0.0, 1.0
    return Sampler(temperature, req.get("top_k", 0), top_p, req.get("min_p", 0.0),
                   None if seed is None else seed + 7919 * index)


def _choice(ctx: Context, req: dict[str, Any], index: int, stop: Stop, pieces: _Pieces) -> int:
    sampler = _sampler(req, index)
    if req.get("logprobs"):
        text, stopped, generated, entries = _choice_logprobs(ctx, req, index, sampler,
                                                             set(ctx.model.stop_tokens), pieces)
        reason = "length" if not stopped and generated >= req["max_tokens"] else "stop"
        send(json.dumps({"index": index, "text": text, "finish_reason": reason,
                         "completion_tokens": generated, "logprobs": entries}))
        return generated
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
        total, pieces = 0, _Pieces(model)
        for i, c in enumerate([ctx, *forks]):
            total += _choice(c, req, i, stop, pieces)
            if c is not ctx:
                c.release()
    send(json.dumps({"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": total}}))


# Requests as the server sends them (host/server/openai_request.py `OpenAIRequest`, every field),
# run while pie-build snapshots the component against the SDK's in-guest stand-in host, so that
# each instance starts with this path already specialized by CPython (inferlet/warmup.py).
_WARM_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "prompt": None, "max_tokens": 8,
                 "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": [], "n": 1,
                 "stream": False, "include_usage": False, "logprobs": False, "top_logprobs": 0,
                 "response_format": None}
WARM_UP_REQUESTS = [json.dumps(_WARM_REQUEST), json.dumps({**_WARM_REQUEST, "stream": True, "include_usage": True})]
warm_up(main, *([r] for r in WARM_UP_REQUESTS))
