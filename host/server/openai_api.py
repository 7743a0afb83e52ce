"""The OpenAI routes, /health and /metrics as Starlette routes over a `Host` (issue 14).

Each completion request launches one instance of the handler program with the validated
request as its JSON argument; the instance's JSON messages (see inferlets/openai_chat and
docs/openai.md) become the response or its SSE chunks. Invariant: a request's instance has ended
when its handler returns — a client that goes away mid-stream terminates it, which frees its pages.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from host.events import InstanceEvent
from host.host import HostBusy
from host.server.metrics import CONTENT_TYPE, ServerMetrics
from host.server.openai_request import OpenAIError, OpenAIRequest, parse_request
from host.server.sse import DONE, chat_chunk, completion_chunk, sse_event

__all__ = ["OpenAIHandler", "openai_app", "openai_routes", "service_routes"]


@dataclasses.dataclass
class OpenAIHandler:
    """What the routes need: the host, the handler program, the model, auth, metrics.

    With `auth_token` or `tenants` ((name, token) pairs, as `ServerConfig.tenants`) set, a request
    needs one of the tokens as its Bearer key; its instance then acts for that token's tenant
    ("default" for `auth_token`), as over the WebSocket protocol.
    """

    host: Any
    program_hash: str
    model: str
    metrics: ServerMetrics
    auth_token: str | None = None
    max_tokens: int = 4096
    tenants: tuple[tuple[str, str], ...] = ()
    running: set[str] = dataclasses.field(default_factory=set)  # instances of requests in progress

    def terminate_all(self, reason: str) -> None:
        """Terminate the instances of every request in progress (the server is stopping)."""
        for iid in list(self.running):
            try:
                self.host.terminate(iid, reason)
            except KeyError:
                pass  # it has just ended


def _error(e: OpenAIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


def _tenant(h: OpenAIHandler, request: Request) -> str:
    """The tenant the request's Bearer key authenticates ("local" when the server has no token)."""
    if h.auth_token is None and not h.tenants:
        return "local"
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    found = None
    if scheme.lower() == "bearer" and key:
        pairs = ((("default", h.auth_token),) if h.auth_token else ()) + h.tenants
        for name, token in pairs:
            if hmac.compare_digest(key.strip().encode(), token.encode()):
                found = name
    if found is None:
        raise OpenAIError(401, "invalid or missing API key (send it as 'Authorization: Bearer <key>')",
                          type_="authentication_error", code="invalid_api_key")
    return found


def _launch(h: OpenAIHandler, req: OpenAIRequest, tenant: str = "local",
            ) -> tuple[str, asyncio.Queue[InstanceEvent]]:
    if req.model != h.model:
        raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {h.model!r}",
                          param="model", code="model_not_found")
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[InstanceEvent] = asyncio.Queue()
    arg = json.dumps(dataclasses.asdict(req))
    extra = {"tenant": tenant} if tenant != "local" else {}
    try:
        iid = h.host.launch(h.program_hash, [arg],
                            lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev), **extra)
    except HostBusy as e:
        raise OpenAIError(503, str(e), type_="server_error", code="overloaded") from None
    h.running.add(iid)
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
        h.running.discard(iid)
        if not done:
            try:
                h.host.terminate(iid, "client went away")
            except KeyError:
                pass  # it ended on its own meanwhile
            h.metrics.instance_ended("client_disconnected")


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
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
            "text_offset": [e["text_offset"] for e in entries]}


def _logprobs(chat: bool, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    return _chat_logprobs(entries) if chat else _completion_logprobs(entries)


def _choice(chat: bool, final: dict[str, Any]) -> dict[str, Any]:
    base = {"index": final["index"], "logprobs": _logprobs(chat, final.get("logprobs")),
            "finish_reason": final["finish_reason"]}
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
    try:
        async for m in _messages(h, iid, queue):
            if "delta" in m:
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
        yield sse_event(e.body())
        yield DONE
        return
    h.metrics.observe_request(first, time.perf_counter() - start, usage.get("prompt_tokens", 0),
                              usage.get("completion_tokens", 0))
    if req.include_usage:
        yield sse_event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": req.model, "choices": [], "usage": usage})
    yield DONE


def _completions(h: OpenAIHandler, chat: bool) -> Any:
    async def endpoint(request: Request) -> Response:
        try:
            tenant = _tenant(h, request)
            req = parse_request(await request.body(), chat, h.max_tokens)
            iid, queue = _launch(h, req, tenant)
            if req.stream:
                return StreamingResponse(_stream(h, req, chat, iid, queue), media_type="text/event-stream")
            return JSONResponse(await _collect(h, req, chat, iid, queue))
        except OpenAIError as e:
            return _error(e)
    return endpoint


def service_routes(metrics: ServerMetrics) -> list[BaseRoute]:
    """`GET /health` and `GET /metrics` (Prometheus text format): served with or without a handler."""
    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def render(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return [Route("/health", health), Route("/metrics", render)]


def openai_routes(h: OpenAIHandler) -> list[BaseRoute]:
    """The HTTP routes of one server: the OpenAI ones, /health and /metrics."""
    async def models(request: Request) -> Response:
        try:
            _tenant(h, request)
        except OpenAIError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": h.model, "object": "model", "created": 0, "owned_by": "pie"}]})

    return [Route("/v1/chat/completions", _completions(h, True), methods=["POST"]),
            Route("/v1/completions", _completions(h, False), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]), *service_routes(h.metrics)]


def openai_app(h: OpenAIHandler) -> Starlette:
    """A Starlette app serving only the HTTP routes (`host.server.Server` serves the same routes next
    to the WebSocket protocol)."""
    return Starlette(routes=openai_routes(h))
