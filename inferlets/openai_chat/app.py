"""openai_chat: the standard handler of the OpenAI endpoint (issue 14).

Argument: one JSON object, the server's validated request (`messages` or `prompt`,
`max_tokens`, sampling fields, `stop`, `n`, `seed`, `stream`, `logprobs`, `top_logprobs`,
`response_format`, `tools`, `tool_choice`, `parallel_tool_calls`, `echo`). Messages sent to the
client, one JSON object each:
  {"error": {"message", "param"}}                           alone: the request cannot be served (400);
  {"index": i, "delta": text[, "logprobs": [entry, ...]]}   while streaming;
  {"index": i, "tool_calls": [{"index": k, ...}]}           while streaming: a call's id and name, its arguments;
  {"index": i, "text": t, "finish_reason": "stop"|"length"|"tool_calls", "completion_tokens": k
   [, "logprobs": [entry, ...]][, "tool_calls": [call, ...]]] per choice;
  {"usage": {"prompt_tokens": p, "completion_tokens": c}}    last.
A user message with images has a list as content: {"type": "text", "text"} and {"type": "image",
"media_type", "data": base64} parts; each image is filled where the template puts it (docs/openai.md,
"Images"), its placeholders counted in prompt_tokens.
Tool calls (docs/openai.md, "Tool calls"): the tools reach the model through its template when it
reads `tools`, else in Hermes' text (`inferlet.toolcalls`); `required` or a named function draws an
array of calls under a grammar of the tools' schemas; `auto` parses the model's `<tool_call>` blocks,
drawn under a grammar (text, or calls that validate) when the template has no call format.
`echo` (completions) puts the prompt first; with logprobs its tokens are scored in the one pass that
prefills it (`Context.flush_scored`, WIT forward.run-scored).
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

import base64
import json
import math
from collections.abc import Callable
from typing import Any, NamedTuple

from inferlet import (
    AnyOf,
    ChatError,
    Context,
    Grammar,
    GrammarError,
    InferletError,
    Matcher,
    Model,
    Sampler,
    Stop,
    TemplateError,
    UntilText,
    UntilTokens,
    _host,
    any_json,
    embed,
    get_model,
    json_schema,
    lark,
    send,
)
from inferlet.context import IMAGE_MARK
from inferlet.toolcalls import (
    CALL_OPEN,
    CallStream,
    ToolCall,
    auto_grammar,
    calls_schema,
    parse_calls,
    plain_chat,
    render_chat,
)
from inferlet.warmup import warm_up

LOOKUP_K = 20  # probabilities returned per step: the drawn token's logprob is exact when among them
VERY_UNLIKELY = -9999.0  # OpenAI's logprob for a token outside the top 20


class ClientError(Exception):
    """The request cannot be served as asked (a schema the grammar compiler refuses, a template that
    cannot render the messages): sent as {"error": ...} before any output, the server answers 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


class Plan(NamedTuple):
    """How every choice of a request is drawn: `mode` "text" (no tool call), "forced" (tool_choice
    required or a named function: an array of calls under a grammar) or "auto" (text or calls in the
    Hermes format, parsed); `tools` the callable ones; `grammar` the whole answer's, if any."""

    mode: str = "text"
    tools: tuple[dict[str, Any], ...] = ()
    grammar: Grammar | None = None


class Echo(NamedTuple):
    """completions' `echo`: the prompt goes before each choice's text, with its tokens' logprobs
    entries (`entries`, when logprobs are asked for) before the choice's."""

    text: str
    entries: list[dict[str, Any]] | None


def _grammar(fmt: dict[str, Any] | None) -> Grammar | None:
    if fmt is None:
        return None
    return any_json() if fmt["type"] == "json_object" else json_schema(fmt["schema"])


def _plan(req: dict[str, Any], native: bool) -> Plan:
    """`_make_plan`, a schema the grammar compiler refuses (too large, a keyword it cannot enforce)
    being the client's error, naming the parameter it came with."""
    try:
        plan = _make_plan(req, native)
        if plan.grammar is not None:
            plan.grammar.compiled()  # the SDK compiles on first use: here, before anything is sent
        return plan
    except GrammarError as e:
        param = "tools" if req.get("tools") and (req.get("tool_choice") or "none") != "none" else "response_format"
        raise ClientError(f"{param}: the schema cannot be used for constrained generation: {e}", param) from None


def _make_plan(req: dict[str, Any], native: bool) -> Plan:
    """The request's Plan (GrammarError when a schema cannot be compiled). With tool_choice auto and
    a response_format, the answer follows the response_format (no call is drawn). `native`: the
    template rendered the tools (its model has a call format of its own, parsed as it comes);
    otherwise an auto answer is drawn under `auto_grammar` (text, or calls that validate)."""
    tools, choice = list(req.get("tools") or []), req.get("tool_choice") or "none"
    parallel = bool(req.get("parallel_tool_calls", True))
    if not tools or choice == "none" or (choice == "auto" and req.get("response_format")):
        return Plan(grammar=_grammar(req.get("response_format")))
    if choice == "auto":
        return Plan("auto", tuple(tools), None if native else lark(auto_grammar(tools, parallel)))
    if isinstance(choice, dict):  # a named function: calls to it only
        tools = [t for t in tools if t["function"]["name"] == choice["function"]["name"]]
    return Plan("forced", tuple(tools), json_schema(calls_schema(tools, parallel)))


def _images(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The image parts of the messages, in order: {"type": "image", "media_type", "data": base64}."""
    return [p for m in messages if isinstance(m.get("content"), list) for p in m["content"] if p.get("type") == "image"]


def _fill_messages(ctx: Context, req: dict[str, Any]) -> bool:
    """Fill the chat; True when the template rendered the tools itself. Without tools or tool
    messages this is `fill_chat`; otherwise the messages (tool calls, tool results) and the tools
    (not with tool_choice none) are rendered by `inferlet.toolcalls.render_chat`. An image part goes
    where the template puts it (a marker in its place in the text the template gets), through the
    model's vision tower (`Context.fill_image`), on the model's image placeholder tokens."""
    messages = req["messages"]
    tools = req.get("tools") if (req.get("tool_choice") or "none") != "none" else None
    images = _images(messages)
    try:
        if plain_chat(messages, tools):
            if images:  # fill_chat takes image parts: {"type": "image", "image": bytes}
                messages = [{**m, "content": [{"type": "image", "image": base64.b64decode(p["data"])}
                                              if p.get("type") == "image" else p for p in m["content"]]}
                            if isinstance(m.get("content"), list) else m for m in messages]
            ctx.fill_chat(messages, add_generation_prompt=True)
            return False
        if images:
            messages = [{**m, "content": "".join(IMAGE_MARK if p.get("type") == "image" else p.get("text", "")
                                                 for p in m["content"])}
                        if isinstance(m.get("content"), list) else m for m in messages]
        model = ctx.model
        try:
            text, native = render_chat(lambda m, t: model.apply_chat_template_json(m, t, True), model.chat_template,
                                       messages, tools)
        except TemplateError as e:
            raise ClientError(f"messages: the model's chat template cannot render them: {e}", "messages") from None
        pieces = text.split(IMAGE_MARK)
        if len(pieces) != len(images) + 1:
            raise ChatError(f"the chat template placed {len(pieces) - 1} of the {len(images)} images")
        for k, piece in enumerate(pieces):
            if piece:
                ctx.fill(piece)
            if k < len(images):
                ctx.fill_image(base64.b64decode(images[k]["data"]), images[k].get("media_type") or "")
        return native
    except embed.EmbedError as e:  # no vision tower, an image that does not decode, the slot limit
        raise ClientError(f"messages: an image cannot be used: {e}", "messages") from None
    except ChatError as e:
        raise ClientError(f"messages: {e}", "messages") from None


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The text before the earliest stop string, and whether one was found."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[: min(hits)], True) if hits else (text, False)


class _Streamer:
    """Sends deltas of one choice, holding back a tail that may begin a stop string.

    With `entries` (logprobs), each delta carries the entries whose text starts before its end."""

    def __init__(self, index: int, stops: list[str], entries: list[dict[str, Any]] | None = None,
                 hold_space: bool = False) -> None:
        self.index, self.stops, self.text, self.sent = index, stops, "", 0
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.entries, self.entries_sent = entries, 0
        self.hold_space = hold_space  # trailing whitespace waits for more text (dropped before a tool call)

    def __call__(self, piece: str) -> None:
        self.text += piece
        visible, _ = _cut(self.text, self.stops)
        upto = len(visible) if len(visible) < len(self.text) else len(visible) - self.hold
        self.flush(len(self.text[:upto].rstrip()) if self.hold_space else upto)

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


def _choice_logprobs(ctx: Context, req: dict[str, Any], index: int, sampler: Sampler, stop_tokens: set[int],
                     pieces: _Pieces, grammar: Grammar | None) -> tuple[str, bool, int, list[dict[str, Any]]]:
    """Generate one choice token by token with logprobs: (text before any stop string, whether one
    was found or a stop token drawn, tokens drawn, the entries of the tokens in the text)."""
    model, stops, top_n = ctx.model, list(req.get("stop") or []), int(req.get("top_logprobs") or 0)
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


def _send_calls(index: int, calls: list[ToolCall]) -> None:
    """Stream calls as OpenAI does: per call, a delta with its index, id and name, then its arguments."""
    for k, c in enumerate(calls):
        fn = c["function"]
        send(json.dumps({"index": index, "tool_calls": [{"index": k, "id": c["id"], "type": "function",
                                                         "function": {"name": fn["name"], "arguments": ""}}]}))
        send(json.dumps({"index": index, "tool_calls": [{"index": k, "function": {"arguments": fn["arguments"]}}]}))


def _tool_choice(ctx: Context, req: dict[str, Any], index: int, plan: Plan, stop: Stop) -> int:
    """One choice that may call tools, drawn under the plan's grammar. While streaming, a forced
    answer's calls go out as they are drawn (id and name, then argument fragments: `CallStream`); in
    an auto answer the text before a call goes out as it comes, its calls once parsed at the end."""
    stops, stream = list(req.get("stop") or []), bool(req.get("stream"))
    follow = CallStream()
    on_text: Callable[[str], None] | None = None
    streamer = None
    if plan.mode == "forced":  # the stop strings do not apply inside the calls' JSON
        stop = UntilTokens(ctx.model.stop_tokens)
        if stream:
            def on_text(piece: str) -> None:
                for d in follow.feed(piece):
                    send(json.dumps({"index": index, "tool_calls": [d]}))
    elif stream:
        on_text = streamer = _Streamer(index, [*stops, CALL_OPEN], hold_space=True)
    before = len(ctx.tokens)
    text = ctx.generate(_sampler(req, index), stop=stop, max_tokens=req["max_tokens"], on_text=on_text,
                        grammar=plan.grammar)
    generated = len(ctx.tokens) - before
    if plan.mode == "forced":  # cut short by max_tokens: the calls it completed, or (none begun) the text
        if not stream:
            follow.feed(text)
        calls = follow.complete()
        content = "" if follow.calls else text
        if stream and content:
            send(json.dumps({"index": index, "delta": content}))
    else:
        content, calls = parse_calls(_cut(text, stops)[0], list(plan.tools))
        if streamer is not None:
            if content.startswith(streamer.text[:streamer.sent]):
                streamer.text = content
                streamer.flush(len(content))
            _send_calls(index, calls)
    stopped = calls or _cut(text, stops)[1]
    reason = "tool_calls" if calls else "length" if not stopped and generated >= req["max_tokens"] else "stop"
    send(json.dumps({"index": index, "text": content, "finish_reason": reason, "completion_tokens": generated,
                     **({"tool_calls": calls} if calls else {})}))
    return generated


def _choice(ctx: Context, req: dict[str, Any], index: int, stop: Stop, pieces: _Pieces, plan: Plan,
            echo: Echo | None = None) -> int:
    if plan.mode != "text":
        return _tool_choice(ctx, req, index, plan, stop)
    head = echo.text if echo is not None else ""
    head_entries = echo.entries if echo is not None and echo.entries is not None else []
    if head and req.get("stream"):
        send(json.dumps({"index": index, "delta": head, **({"logprobs": head_entries} if req.get("logprobs") else {})}))
    if req["max_tokens"] == 0:  # echo alone (completions' max_tokens 0)
        send(json.dumps({"index": index, "text": head, "finish_reason": "length", "completion_tokens": 0,
                         **({"logprobs": head_entries} if req.get("logprobs") else {})}))
        return 0
    sampler = _sampler(req, index)
    if req.get("logprobs"):
        text, stopped, generated, entries = _choice_logprobs(ctx, req, index, sampler,
                                                             set(ctx.model.stop_tokens), pieces, plan.grammar)
        reason = "length" if not stopped and generated >= req["max_tokens"] else "stop"
        entries = head_entries + [{**e, "text_offset": e["text_offset"] + len(head)} for e in entries]
        send(json.dumps({"index": index, "text": head + text, "finish_reason": reason,
                         "completion_tokens": generated, "logprobs": entries}))
        return generated
    stops = list(req.get("stop") or [])
    streamer = _Streamer(index, stops) if req.get("stream") else None
    before = len(ctx.tokens)
    on_text: Callable[[str], None] | None = streamer
    text = ctx.generate(sampler, stop=stop, max_tokens=req["max_tokens"], on_text=on_text,
                        grammar=plan.grammar)
    generated = len(ctx.tokens) - before
    text, stopped = _cut(text, stops)
    if streamer is not None:
        streamer.text = text
        streamer.flush(len(text))
    reason = "length" if not stopped and generated >= req["max_tokens"] else "stop"
    send(json.dumps({"index": index, "text": head + text, "finish_reason": reason,
                     "completion_tokens": generated}))
    return generated


def _prompt_entries(ctx: Context, top_n: int, pieces: _Pieces) -> list[dict[str, Any]]:
    """Echo's logprobs: an entry per prompt token, each scored given the ones before it in one pass
    over the prompt (`Context.flush_scored`); the first token's logprob is null (nothing before it)."""
    tokens, model = list(ctx.tokens), ctx.model
    scores = ctx.flush_scored(top_n)
    entries, text = [], ""
    for i, token in enumerate(tokens):
        grown = model.decode(tokens[: i + 1])
        piece = grown[len(text):]
        if i == 0:
            entries.append({"token": piece, "logprob": None, "bytes": list(piece.encode()), "text_offset": 0,
                            "top_logprobs": None})
        else:
            logprob, ids, probs = scores[i - 1]
            entries.append({**_entry(piece, token, len(text), ids, probs, top_n, pieces), "logprob": logprob})
        text = grown
    return entries


def _fill_prompt(ctx: Context, prompt: str | list[int]) -> None:
    """A completions prompt: its text, or its token ids (ClientError for one outside the vocabulary)."""
    if isinstance(prompt, str):
        ctx.fill(prompt)
        return
    bad = [t for t in prompt if t >= ctx.model.vocab_size]
    if bad:
        raise ClientError(f"prompt: token id {bad[0]} is outside the vocabulary (size {ctx.model.vocab_size})",
                          "prompt")
    ctx.fill_tokens(prompt)


def _refuse(e: ClientError) -> None:
    send(json.dumps({"error": {"message": e.message, "param": e.param}}))


def main(args: list[str]) -> None:
    if len(args) != 1:
        raise InferletError(f"openai_chat takes one JSON request argument, got {len(args)}")
    req = json.loads(args[0])
    model = get_model()
    echo = bool(req.get("echo")) and req.get("prompt") is not None
    scored = echo and bool(req.get("logprobs"))
    with Context(model, prefix_cache=not scored) as ctx:  # a cached prefix would not be scored
        try:
            native = False
            if req.get("messages") is not None:
                native = _fill_messages(ctx, req)
            else:
                _fill_prompt(ctx, req["prompt"])
            plan = _plan(req, native)
        except ClientError as e:
            _refuse(e)
            return
        prompt_tokens = len(ctx.tokens)
        pieces = _Pieces(model)
        prompt = req["prompt"] if isinstance(req.get("prompt"), str) else model.decode(ctx.tokens)
        head = Echo(prompt, _prompt_entries(ctx, int(req.get("top_logprobs") or 0), pieces) if scored
                    else None) if echo else None
        stop: Stop = AnyOf(UntilTokens(model.stop_tokens), *(UntilText(s) for s in req.get("stop") or []))
        if req.get("n", 1) > 1:
            ctx.flush()  # prefill once: the forks then share the prompt's full pages
        forks = [ctx.fork() for _ in range(req.get("n", 1) - 1)]
        total = 0
        for i, c in enumerate([ctx, *forks]):
            total += _choice(c, req, i, stop, pieces, plan, head)
            if c is not ctx:
                c.release()
    send(json.dumps({"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": total}}))


# Requests as the server sends them (host/server/openai_request.py `OpenAIRequest`, every field),
# run while pie-build snapshots the component against the SDK's in-guest stand-in host, so that
# each instance starts with this path already specialized by CPython (inferlet/warmup.py).
_WARM_REQUEST = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "prompt": None, "max_tokens": 8,
                 "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "seed": None, "stop": [], "n": 1,
                 "stream": False, "include_usage": False, "logprobs": False, "top_logprobs": 0,
                 "response_format": None, "tools": None, "tool_choice": "none", "parallel_tool_calls": True,
                 "echo": False}
WARM_UP_REQUESTS = [json.dumps(_WARM_REQUEST), json.dumps({**_WARM_REQUEST, "stream": True, "include_usage": True})]
warm_up(main, *([r] for r in WARM_UP_REQUESTS))
