"""`POST /v1/chat/completions` and `POST /v1/completions`: a request run by the chat handler
program (inferlets/openai_chat), its messages turned into a completion object or its SSE chunks,
logprobs in each endpoint's shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from host.server.http import GuardedStream
from host.server.openai_errors import OpenAIError
from host.server.openai_handler import OpenAIHandler
from host.server.openai_request import OpenAIRequest, parse_request
from host.server.openai_run import Run, answer, checked, handler_messages, launch, read_or_release
from host.server.sse import DONE, chat_chunk, completion_chunk, sse_event

__all__ = ["respond_completion", "stream_completion"]


# ---- logprobs: the handler's entries in OpenAI's two shapes ------------------------------------
def _chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """`choices[i].logprobs` of a chat completion: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    if entries is None:
        return None
    return {"content": [{k: e[k] for k in ("token", "logprob", "bytes", "top_logprobs")} for e in entries],
            "refusal": None}


def _completion_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """The legacy completions shape: {tokens, token_logprobs, top_logprobs, text_offset}."""
    if entries is None:
        return None
    return {"tokens": [e["token"] for e in entries],
            "token_logprobs": [e["logprob"] for e in entries],  # null for an echoed prompt's first token
            "top_logprobs": [None if e["top_logprobs"] is None else {t["token"]: t["logprob"] for t in e["top_logprobs"]}
                             for e in entries],
            "text_offset": [e["text_offset"] for e in entries]}


def _logprobs(chat: bool, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    return _chat_logprobs(entries) if chat else _completion_logprobs(entries)


def _choice(chat: bool, final: dict[str, Any]) -> dict[str, Any]:
    base = {"index": final["index"], "logprobs": _logprobs(chat, final.get("logprobs")),
            "finish_reason": final["finish_reason"]}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": final["text"]}
        if final.get("tool_calls"):  # content null unless the model also wrote text
            message = {"role": "assistant", "content": final["text"] or None, "tool_calls": final["tool_calls"]}
        return {**base, "message": message}
    return {**base, "text": final["text"]}


def _usage(u: dict[str, Any]) -> dict[str, int]:
    p, c = u["prompt_tokens"], u["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _collect(h: OpenAIHandler, req: OpenAIRequest, chat: bool, run: Run) -> dict[str, Any]:
    start, first, choices, usage = time.perf_counter(), 0.0, [], {}
    try:
        async for m in handler_messages(run):
            if "text" in m:
                first = first or time.perf_counter() - start
                choices.append(_choice(chat, m))
            elif "usage" in m:
                usage = _usage(m["usage"])
    finally:  # also when cancelled (the client went away): terminates the instance
        run.close()
    h.metrics.observe_request(first, time.perf_counter() - start, usage.get("prompt_tokens", 0),
                              usage.get("completion_tokens", 0))
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{run.iid}", "created": int(time.time()),
            "object": "chat.completion" if chat else "text_completion", "model": req.model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage}


async def stream_completion(h: OpenAIHandler, req: OpenAIRequest, chat: bool, run: Run,
                  messages: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The SSE events of one request; whoever stops iterating early calls `run.close()`."""
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    start, first, usage = time.perf_counter(), 0.0, {}
    if chat:
        for i in range(req.n):
            yield sse_event(chat_chunk(rid, created, req.model, i, {"role": "assistant", "content": ""}))
    try:
        async for m in messages:
            if "tool_calls" in m and "text" not in m:  # a call's id and name, or a fragment of its arguments
                first = first or time.perf_counter() - start
                yield sse_event(chat_chunk(rid, created, req.model, m["index"], {"tool_calls": m["tool_calls"]}))
            elif "delta" in m:
                first = first or time.perf_counter() - start
                lp = _logprobs(chat, m.get("logprobs"))
                yield sse_event(chat_chunk(rid, created, req.model, m["index"], {"content": m["delta"]},
                                           logprobs=lp)
                                if chat else completion_chunk(rid, created, req.model, m["index"], m["delta"],
                                                              logprobs=lp))
            elif "text" in m:
                yield sse_event(chat_chunk(rid, created, req.model, m["index"], {}, m["finish_reason"])
                                if chat else completion_chunk(rid, created, req.model, m["index"], "",
                                                              m["finish_reason"]))
            elif "usage" in m:
                usage = _usage(m["usage"])
    except OpenAIError as e:  # the handler failed mid-stream: OpenAI's clients raise on an error event
        run.close()
        yield sse_event(e.body())
        yield DONE
        return
    run.close()
    h.metrics.observe_request(first, time.perf_counter() - start, usage.get("prompt_tokens", 0),
                              usage.get("completion_tokens", 0))
    if req.include_usage:
        yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": req.model, "choices": [], "usage": usage})
    yield DONE


async def respond_completion(h: OpenAIHandler, request: Request, chat: bool, tenant: str,
                   release: Callable[[], None]) -> Response:
    """Read, check and run one completion request; `release` is called once it has ended."""
    body = await read_or_release(h, request, release)
    if body is None:
        return Response(status_code=400)  # nobody reads it
    req = parse_request(body, chat, h.max_tokens)
    return await _run_request(h, request, req, chat, tenant, release)


async def _run_request(h: OpenAIHandler, request: Request, req: OpenAIRequest, chat: bool, tenant: str,
                       release: Callable[[], None]) -> Response:
    """Check, launch and answer one validated chat or completions request."""
    req = await checked(h, req, tenant)
    run = launch(h, req, tenant)
    if req.stream:  # a handler's refusal then comes as the stream's error event (the status is sent)
        def close() -> None:
            run.close()
            release()
        return GuardedStream(stream_completion(h, req, chat, run, handler_messages(run)), h.write_timeout_s, close)
    return await answer(request, _collect(h, req, chat, run), release)
