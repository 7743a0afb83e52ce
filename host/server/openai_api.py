"""The OpenAI routes, /health and /metrics as a Starlette app over a `Host` (issue 14).

Each completion request launches one instance of the handler program with the validated
request as its JSON argument; the instance's JSON messages (see inferlets/openai_chat) become
the response or its SSE chunks. Invariant: a request's instance has ended when its handler
returns — a client that goes away mid-stream terminates it, which frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from host.events import InstanceEvent
from host.host import HostBusy
from host.server.metrics import CONTENT_TYPE, ServerMetrics
from host.server.openai_request import OpenAIError, OpenAIRequest, parse_request
from host.server.sse import DONE, chat_chunk, completion_chunk, sse_event

__all__ = ["OpenAIHandler", "openai_app", "openai_routes"]


@dataclasses.dataclass
class OpenAIHandler:
    """What the routes need: the host, the handler program, the model, auth, metrics."""

    host: Any
    program_hash: str
    model: str
    metrics: ServerMetrics
    auth_token: str | None = None
    max_tokens: int = 4096


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _check_auth(h: OpenAIHandler, request: Request) -> None:
    if h.auth_token is not None and request.headers.get("authorization") != f"Bearer {h.auth_token}":
        raise OpenAIError(401, "invalid or missing API key", type_="authentication_error",
                          code="invalid_api_key")


def _launch(h: OpenAIHandler, req: OpenAIRequest) -> tuple[str, asyncio.Queue[InstanceEvent]]:
    if req.model != h.model:
        raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {h.model!r}",
                          param="model", code="model_not_found")
    if req.logprobs:  # the standard handler does not produce them yet: say so, never answer null
        raise OpenAIError(400, "logprobs: not supported by this server's handler yet", param="logprobs")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[InstanceEvent] = asyncio.Queue()
    arg = json.dumps(dataclasses.asdict(req))
    try:
        iid = h.host.launch(h.program_hash, [arg],
                            lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev))
    except HostBusy as e:
        raise OpenAIError(503, str(e), type_="server_error", code="overloaded") from None
    return iid, queue


async def _messages(h: OpenAIHandler, iid: str, queue: asyncio.Queue[InstanceEvent],
                    ) -> AsyncIterator[dict[str, Any]]:
    """The instance's JSON messages until it ends; terminates it if the consumer stops early."""
    done = False
    try:
        while True:
            ev = await queue.get()
            if ev.event == "message":
                yield json.loads(ev.message)
                continue
            done = True
            h.metrics.instance_ended(ev.event)
            if ev.event != "completed":
                raise OpenAIError(500, f"handler instance {iid} ended with {ev.event}: {ev.message}",
                                  type_="server_error")
            return
    finally:
        if not done:
            h.host.terminate(iid, "client went away")
            h.metrics.instance_ended("client_disconnected")


def _choice(chat: bool, final: dict[str, Any]) -> dict[str, Any]:
    base = {"index": final["index"], "logprobs": None, "finish_reason": final["finish_reason"]}
    if chat:
        return {**base, "message": {"role": "assistant", "content": final["text"]}}
    return {**base, "text": final["text"]}


def _usage(u: dict[str, Any]) -> dict[str, int]:
    p, c = u["prompt_tokens"], u["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


async def _collect(h: OpenAIHandler, req: OpenAIRequest, chat: bool, iid: str,
                   queue: asyncio.Queue[InstanceEvent]) -> dict[str, Any]:
    start, first, choices, usage = time.perf_counter(), 0.0, [], {}
    async for m in _messages(h, iid, queue):
        if "text" in m:
            first = first or time.perf_counter() - start
            choices.append(_choice(chat, m))
        elif "usage" in m:
            usage = _usage(m["usage"])
    h.metrics.observe_request(first, time.perf_counter() - start, usage.get("prompt_tokens", 0),
                              usage.get("completion_tokens", 0))
    return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{iid}", "created": int(time.time()),
            "object": "chat.completion" if chat else "text_completion", "model": req.model,
            "choices": sorted(choices, key=lambda c: c["index"]), "usage": usage}


async def _stream(h: OpenAIHandler, req: OpenAIRequest, chat: bool, iid: str,
                  queue: asyncio.Queue[InstanceEvent]) -> AsyncIterator[bytes]:
    rid, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())
    start, first, usage = time.perf_counter(), 0.0, {}
    if chat:
        for i in range(req.n):
            yield sse_event(chat_chunk(rid, created, req.model, i, {"role": "assistant", "content": ""}))
    async for m in _messages(h, iid, queue):
        if "delta" in m:
            first = first or time.perf_counter() - start
            yield sse_event(chat_chunk(rid, created, req.model, m["index"], {"content": m["delta"]})
                            if chat else completion_chunk(rid, created, req.model, m["index"], m["delta"]))
        elif "text" in m:
            yield sse_event(chat_chunk(rid, created, req.model, m["index"], {}, m["finish_reason"])
                            if chat else completion_chunk(rid, created, req.model, m["index"], "",
                                                          m["finish_reason"]))
        elif "usage" in m:
            usage = _usage(m["usage"])
    h.metrics.observe_request(first, time.perf_counter() - start, usage.get("prompt_tokens", 0),
                              usage.get("completion_tokens", 0))
    if req.include_usage:
        yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": req.model, "choices": [], "usage": usage})
    yield DONE


def _completions(h: OpenAIHandler, chat: bool) -> Any:
    async def endpoint(request: Request) -> Response:
        try:
            _check_auth(h, request)
            req = parse_request(await request.body(), chat, h.max_tokens)
            iid, queue = _launch(h, req)
            if req.stream:
                return StreamingResponse(_stream(h, req, chat, iid, queue), media_type="text/event-stream")
            return JSONResponse(await _collect(h, req, chat, iid, queue))
        except OpenAIError as e:
            return _error(e)
    return endpoint


def openai_routes(h: OpenAIHandler) -> list[Route]:
    """The HTTP routes of one server."""
    async def models(request: Request) -> Response:
        try:
            _check_auth(h, request)
        except OpenAIError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": h.model, "object": "model", "created": 0, "owned_by": "pie"}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(h.metrics.render(), media_type=CONTENT_TYPE)

    return [Route("/v1/chat/completions", _completions(h, True), methods=["POST"]),
            Route("/v1/completions", _completions(h, False), methods=["POST"]),
            Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics)]


def openai_app(h: OpenAIHandler) -> Starlette:
    """A Starlette app serving only the HTTP routes (the WebSocket server mounts the same routes)."""
    return Starlette(routes=openai_routes(h))
