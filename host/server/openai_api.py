"""The OpenAI routes, /health and /metrics as Starlette routes over a `Host` (issue 14).

Each request launches one instance of a handler program with the validated request as its JSON
argument; the instance's JSON messages (see inferlets/openai_chat and docs/openai.md) become the
response or its SSE chunks. Here: the endpoint wrapper (auth, a tenant's requests in progress,
errors), the /v1/responses and /v1/embeddings routes, /v1/models, /health and /metrics. Chat and
completions are host/server/openai_chat.py; a request's instance is host/server/openai_run.py;
the handler's settings host/server/openai_handler.py.

Bounds (docs/openai.md): the body is read only up to `max_body_bytes` (413 before reading when
Content-Length says more), each piece of it within `read_timeout_s` (408); a tenant has at most
`TenantLimits.max_connections` requests in progress and `max_instances` instances (429); a prompt
that cannot fit the model's context or the KV pages one request may hold is a 400
`context_length_exceeded` before anything is launched.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from host.server.http import GuardedStream
from host.server.metrics import CONTENT_TYPE, ServerMetrics
from host.server.openai_budget import PromptBudget
from host.server.openai_chat import respond_completion
from host.server.openai_embeddings import EmbeddingRequest, check_inputs, parse_embeddings
from host.server.openai_embeddings import response as embeddings_response
from host.server.openai_errors import OpenAIError
from host.server.openai_handler import ModelFacts, OpenAIHandler, error_response, tenant_of
from host.server.openai_request import load_body, request_of
from host.server.openai_responses import ResponseBuilder, chat_body
from host.server.openai_run import Run, answer, checked, handler_messages, launch, observe, read_or_release
from host.server.sse import sse_typed
from host.server.tenants import TenantLimitError

# (the handler's names, for the routes' users)
__all__ = ["ModelFacts", "OpenAIHandler", "PromptBudget", "internal_error", "openai_app", "openai_routes",
           "service_routes"]

log = logging.getLogger(__name__)


# ---- /v1/responses (host/server/openai_responses.py has the conversions) ------------------------

_RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


async def _respond_responses(h: OpenAIHandler, request: Request, tenant: str,
                             release: Callable[[], None]) -> Response:
    """Read, check and run one Responses request; `release` is called once it has ended."""
    raw = await read_or_release(h, request, release)
    if raw is None:
        return Response(status_code=400)  # nobody reads it
    body = load_body(raw)
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise OpenAIError(400, "previous_response_id: expected a string", param="previous_response_id")
    history = h.responses.get(prev, tenant) if prev else []
    chat = chat_body(body, history)
    try:
        req = request_of(chat, True, h.max_tokens)
    except OpenAIError as e:  # name the Responses parameter
        e.param = _RESPONSES_PARAMS.get(e.param or "", e.param)
        e.message = f"{e.param}:{e.message.partition(':')[2]}" if e.param else e.message
        raise
    kept = chat["messages"][1:] if body.get("instructions") is not None else chat["messages"]
    builder = ResponseBuilder(body, req.model)
    try:
        req = await checked(h, req, tenant)
    except OpenAIError as e:  # (an image's problem, a prompt too long: name the Responses parameter)
        if e.param == "messages":
            e.param, e.message = "input", "input" + e.message.removeprefix("messages")
        raise
    run = launch(h, req, tenant)

    def store() -> None:
        if body.get("store", True) is not False:
            h.responses.put(builder.id, tenant, builder.conversation(kept))

    if req.stream:
        def close() -> None:
            run.close()
            release()
        return GuardedStream(_response_events(h, builder, run, handler_messages(run), store), h.write_timeout_s, close)
    return await answer(request, _response_object(h, builder, run, store), release)


async def _response_object(h: OpenAIHandler, builder: ResponseBuilder, run: Run,
                           store: Callable[[], None]) -> dict[str, Any]:
    start, first = time.perf_counter(), 0.0
    try:
        async for m in handler_messages(run):
            first = first or time.perf_counter() - start
            builder.feed(m)
    finally:  # also when cancelled (the client went away): terminates the instance
        run.close()
    builder.finish()
    store()
    observe(h, start, first, builder.usage)
    return builder.object()


async def _response_events(h: OpenAIHandler, builder: ResponseBuilder, run: Run,
                           messages: AsyncIterator[dict[str, Any]], store: Callable[[], None]) -> AsyncIterator[bytes]:
    """The Responses SSE stream (`event: <type>` lines and `data: <json>`); a handler failing mid-stream
    ends it with an `error` event."""
    start, first = time.perf_counter(), 0.0
    for ev in builder.start():
        yield sse_typed(ev)
    try:
        async for m in messages:
            first = first or time.perf_counter() - start
            for ev in builder.feed(m):
                yield sse_typed(ev)
    except OpenAIError as e:
        run.close()
        yield sse_typed({"type": "error", "sequence_number": builder.seq, "code": e.code, "message": e.message,
                         "param": e.param})
        return
    run.close()
    for ev in builder.finish():
        yield sse_typed(ev)
    store()
    observe(h, start, first, builder.usage)


# ---- /v1/embeddings (host/server/openai_embeddings.py has the request and the answer) -------------

async def _respond_embeddings(h: OpenAIHandler, request: Request, tenant: str,
                              release: Callable[[], None]) -> Response:
    """Read, check and run one embeddings request; `release` is called once it has ended."""
    raw = await read_or_release(h, request, release)
    if raw is None:
        return Response(status_code=400)  # nobody reads it
    req = parse_embeddings(load_body(raw))
    if h.embedding_program is None:
        raise OpenAIError(400, "this server serves no embeddings (pie-serve --embedding-handler none)",
                          param="model")
    if req.model != h.model:
        raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {h.model!r}",
                          param="model", code="model_not_found")
    f = h.facts or ModelFacts()
    await asyncio.to_thread(check_inputs, req, f.hidden_size, f.vocab_size, f.embed_tokens, f.count, f.matryoshka)
    run = launch(h, req, tenant, h.embedding_program)
    return await answer(request, _embeddings(req, run), release)


async def _embeddings(req: EmbeddingRequest, run: Run) -> dict[str, Any]:
    vectors: dict[int, list[float]] = {}
    tokens = 0
    try:
        async for m in handler_messages(run):
            if "embedding" in m:
                vectors[int(m["index"])] = m["embedding"]
            elif "usage" in m:
                tokens = int(m["usage"].get("prompt_tokens", 0))
    finally:  # also when cancelled (the client went away): terminates the instance
        run.close()
    missing = [i for i in range(len(req.inputs)) if i not in vectors]
    if missing:
        log.warning("embedding handler instance %s completed without input %d's vector", run.iid, missing[0])
        raise OpenAIError(500, f"the embedding handler (instance {run.iid}) gave no vector for input {missing[0]}",
                          type_="server_error")
    return await asyncio.to_thread(embeddings_response, req, vectors, tokens)


Respond = Callable[[OpenAIHandler, Request, str, Callable[[], None]], Awaitable[Response]]


def _completions(h: OpenAIHandler, chat: bool) -> Any:
    async def respond(h: OpenAIHandler, request: Request, tenant: str, release: Callable[[], None]) -> Response:
        return await respond_completion(h, request, chat, tenant, release)
    return _endpoint(h, respond)


def _endpoint(h: OpenAIHandler, respond: Respond) -> Any:
    """A POST route that runs a handler instance: auth, the tenant's requests in progress, errors."""
    async def endpoint(request: Request) -> Response:
        try:
            tenant = tenant_of(h, request)
            if h.stopping:
                raise OpenAIError(503, "the server is shutting down", type_="server_error", code="overloaded")
            try:
                h.limits.take_connection(tenant)
            except TenantLimitError as e:
                raise OpenAIError(429, str(e), type_="rate_limit_error", code="rate_limit_exceeded") from None
            released = False

            def release() -> None:
                nonlocal released
                if not released:
                    released = True
                    h.limits.give_connection(tenant)

            try:
                response = await respond(h, request, tenant, release)
            except BaseException:
                release()
                raise
            if not isinstance(response, GuardedStream):
                release()
            return response
        except OpenAIError as e:
            return error_response(e)
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
            tenant_of(h, request)
        except OpenAIError as e:
            return error_response(e)
        return JSONResponse({"object": "list", "data": [
            {"id": h.model, "object": "model", "created": 0, "owned_by": "pie"}]})

    return [Route("/v1/chat/completions", _completions(h, True), methods=["POST"]),
            Route("/v1/completions", _completions(h, False), methods=["POST"]),
            Route("/v1/responses", _endpoint(h, _respond_responses), methods=["POST"]),
            Route("/v1/embeddings", _endpoint(h, _respond_embeddings), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]), *service_routes(h.metrics)]


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug while answering: OpenAI's error object, 500, naming nothing of the server's insides (the
    traceback goes to the log, as Starlette logs every unhandled exception)."""
    return JSONResponse(OpenAIError(500, "internal server error; the server's log has the details",
                                    type_="server_error").body(), status_code=500)


def openai_app(h: OpenAIHandler) -> Starlette:
    """A Starlette app serving only the HTTP routes (`host.server.Server` serves the same routes next
    to the WebSocket protocol)."""
    return Starlette(routes=openai_routes(h), exception_handlers={Exception: internal_error})
