"""The OpenAI routes, /health and /metrics as Starlette routes over a `Host` (issue 14).

Each completion request launches one instance of the handler program with the validated
request as its JSON argument; the instance's JSON messages (see inferlets/openai_chat and
docs/openai.md) become the response or its SSE chunks. Invariant: a request's instance has ended
(or been told to) when its handler returns: a client that goes away, streaming or not, or that
stops reading an SSE stream for `write_timeout_s`, terminates it, which frees its pages.

Bounds (docs/openai.md): the body is read only up to `max_body_bytes` (413 before reading when
Content-Length says more), each piece of it within `read_timeout_s` (408); a tenant has at most
`TenantLimits.max_connections` requests in progress and `max_instances` instances (429); a prompt
that cannot fit the model's context or the KV pages one request may hold is a 400
`context_length_exceeded` before anything is launched.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from host.events import InstanceEvent
from host.host import HostBusy
from host.server.http import GuardedStream, read_body, until_disconnect
from host.server.metrics import CONTENT_TYPE, ServerMetrics
from host.server.openai_budget import PromptBudget
from host.server.openai_embeddings import EmbeddingRequest, check_inputs, parse_embeddings
from host.server.openai_embeddings import response as embeddings_response
from host.server.openai_images import ImageFetcher, ImageLimits, count_images, resolve_images
from host.server.openai_request import (
    OpenAIError,
    OpenAIRequest,
    load_body,
    parse_request,
    request_of,
    schema_problems,
)
from host.server.openai_responses import ResponseBuilder, ResponseStore, chat_body
from host.server.sse import DONE, chat_chunk, completion_chunk, sse_event, sse_typed
from host.server.tenants import TenantLimitError, TenantLimits

__all__ = ["ModelFacts", "OpenAIHandler", "PromptBudget", "internal_error", "openai_app", "openai_routes",
           "service_routes"]

log = logging.getLogger(__name__)
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What the routes check requests against (None: not known, not checked; a test's fake host)."""

    image_tokens: int | None = None  # vectors per image; 0: no vision tower
    hidden_size: int | None = None  # an embedding's width; 0: the backend gives no hidden states
    vocab_size: int | None = None
    embed_tokens: int | None = None  # the most tokens one embedding input may have (context, KV pages)
    count: Callable[[str], int] | None = None  # a string's tokens, as the embedding handler tokenizes it

    @classmethod
    def of(cls, host: Any, budget: PromptBudget | None) -> ModelFacts:
        backend = getattr(host, "backend", None)
        info = getattr(backend, "info", None)
        if backend is None or info is None:
            return cls()
        tok = backend.tokenizer
        limits = [x for x in (info.max_position, budget.kv_tokens if budget is not None else 0) if x]
        return cls(int(getattr(info, "image_tokens", 0) or 0), int(getattr(info, "hidden_size", 0) or 0),
                   info.vocab_size, min(limits) if limits else None, lambda text: len(tok.encode_prompt(text)))


@dataclasses.dataclass
class OpenAIHandler:
    """What the routes need: the host, the handler program, the model, auth, metrics, limits.

    With `auth_token` or `tenants` ((name, token) pairs, as `ServerConfig.tenants`) set, a request
    needs one of the tokens as its Bearer key; its instance then acts for that token's tenant
    ("default" for `auth_token`), as over the WebSocket protocol. `limits` (shared with the
    WebSocket side) caps a tenant's requests in progress and running instances.
    """

    host: Any
    program_hash: str
    model: str
    metrics: ServerMetrics
    auth_token: str | None = None
    max_tokens: int = 4096
    tenants: tuple[tuple[str, str], ...] = ()
    running: set[str] = dataclasses.field(default_factory=set)  # instances of requests in progress
    limits: TenantLimits = dataclasses.field(default_factory=lambda: TenantLimits(None, 1 << 30))
    max_body_bytes: int = 8 * MIB
    read_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    max_queued_bytes: int = 16 * MIB  # messages of one request's instance not yet sent to its client
    budget: PromptBudget | None = None  # None: PromptBudget.of(host)
    stopping: bool = False  # the server is shutting down: new requests get 503
    responses: ResponseStore = dataclasses.field(default_factory=ResponseStore)  # for previous_response_id
    embedding_program: str | None = None  # the /v1/embeddings handler (inferlets/openai_embed); None: not served
    images: ImageLimits = dataclasses.field(default_factory=ImageLimits)  # chat's image parts
    facts: ModelFacts | None = None  # None: ModelFacts.of(host)
    image_fetcher: ImageFetcher | None = None  # None: made when images.allow_remote is set

    def __post_init__(self) -> None:
        if self.budget is None:
            self.budget = PromptBudget.of(self.host)
        if self.facts is None:
            self.facts = ModelFacts.of(self.host, self.budget)
        if self.image_fetcher is None and self.images.allow_remote:
            self.image_fetcher = ImageFetcher(self.images)

    def terminate_all(self, reason: str) -> None:
        """Terminate the instances of every request in progress (the server is stopping)."""
        self.stopping = True
        for iid in list(self.running):
            try:
                self.host.terminate(iid, reason)
            except KeyError:
                pass  # it has just ended


def _error(e: OpenAIError) -> JSONResponse:
    # A 413 or 408 leaves the body unread: the connection closes after the answer.
    headers = {"connection": "close"} if e.status in (408, 413) else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


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


@dataclasses.dataclass
class _Run:
    """One request's instance. Invariant: `close` runs exactly once per launch, and then the
    instance has ended or has been told to (terminated: the client went away) and its tenant's
    running count is given back."""

    h: OpenAIHandler
    queue: asyncio.Queue[InstanceEvent]
    tenant: str
    loop: asyncio.AbstractEventLoop
    iid: str = ""
    ended: bool = False  # its terminal event has been seen
    closed: bool = False
    # Bytes of messages handed to the loop and not yet taken by `get`, at most `h.max_queued_bytes`.
    # Counted on the instance's thread, before the hand-off: the loop's own queue of callbacks is
    # unbounded, and an instance can emit faster than a busy loop runs them.
    queued_bytes: int = 0
    overflowed: bool = False  # past it: terminated, later messages dropped (its terminal event still comes)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def offer(self, ev: InstanceEvent) -> None:
        """The instance's `on_event` (its thread): hand the event to the loop. An instance whose
        messages pile up (the client does not read them) past `max_queued_bytes` is terminated and
        the request fails."""
        size = len(ev.message) if ev.event == "message" else 0
        with self.lock:
            if self.overflowed and size:
                return
            over = size > 0 and self.queued_bytes + size > self.h.max_queued_bytes
            if over:
                self.overflowed = True
            else:
                self.queued_bytes += size
        try:
            self.loop.call_soon_threadsafe(self._overflow if over else self.put, ev)
        except RuntimeError:  # loop closed: the server has stopped
            pass

    def _overflow(self, ev: InstanceEvent) -> None:  # on the loop
        if not self.closed:
            log.warning("instance %s: %d bytes of messages queued for an HTTP client that does not read them; "
                        "ending it", self.iid, self.queued_bytes)
            self.terminate("client not reading")

    def put(self, ev: InstanceEvent) -> None:  # on the loop
        if self.closed:
            return
        self.queue.put_nowait(ev)

    async def get(self) -> InstanceEvent:
        ev = await self.queue.get()
        if ev.event == "message":
            with self.lock:
                self.queued_bytes -= len(ev.message)
        return ev

    def terminate(self, reason: str) -> None:
        try:
            self.h.host.terminate(self.iid, reason)
        except KeyError:
            pass  # it ended on its own meanwhile

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.h.running.discard(self.iid)
        self.h.limits.give_instance(self.tenant)
        if not self.ended:
            self.terminate("client went away")
            self.h.metrics.instance_ended("client_disconnected")


def _launch(h: OpenAIHandler, req: OpenAIRequest | EmbeddingRequest, tenant: str = "local",
            program: str | None = None) -> _Run:
    """Launch `program` (default: the chat handler) with the request as its argument."""
    if req.model != h.model:
        raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {h.model!r}",
                          param="model", code="model_not_found")
    loop = asyncio.get_running_loop()
    run = _Run(h, asyncio.Queue(), tenant, loop)
    arg = req.handler_argument()
    extra: dict[str, Any] = {"tenant": tenant} if tenant != "local" else {}
    if req.priority:
        extra["priority"] = req.priority
    try:
        h.limits.take_instance(tenant)
    except TenantLimitError as e:
        raise OpenAIError(429, str(e), type_="rate_limit_error", code="rate_limit_exceeded") from None
    try:
        run.iid = h.host.launch(program or h.program_hash, [arg], run.offer, **extra)
    except BaseException as e:
        h.limits.give_instance(tenant)  # nothing was launched
        if isinstance(e, HostBusy):
            raise OpenAIError(503, str(e), type_="server_error", code="overloaded") from None
        raise
    h.running.add(run.iid)
    return run


def _first_line(text: str) -> str:
    return text.splitlines()[0][:200] if text else ""


def _failure(iid: str, ev: InstanceEvent) -> OpenAIError:
    """The error for a handler instance that did not complete; what it said goes to the log only
    (a trap message carries the guest's backtrace)."""
    log.warning("OpenAI handler instance %s ended with %s: %s", iid, ev.event, ev.message)
    if ev.event == "out_of_resources":
        return OpenAIError(503, f"the server ran out of resources for this request (instance {iid}): "
                           f"{_first_line(ev.message)}; try again later", type_="server_error", code="overloaded")
    if ev.event == "aborted":
        return OpenAIError(503, f"the request was aborted: {_first_line(ev.message)}", type_="server_error",
                           code="aborted")
    return OpenAIError(500, f"the handler of this request failed (instance {iid}, {ev.event}); the server's "
                       "log has the reason", type_="server_error")


async def _messages(run: _Run) -> AsyncIterator[dict[str, Any]]:
    """The instance's JSON messages until it ends; the caller calls `run.close()` when done with it.
    A handler's {"error": {"message", "param"}} (the request cannot be served as asked: a schema its
    grammar compiler refuses, messages its template cannot render) is a 400."""
    while True:
        ev = await run.get()
        if ev.event == "message":
            m = json.loads(ev.message)
            if "error" in m:
                err = m["error"] if isinstance(m["error"], dict) else {"message": str(m["error"])}
                raise OpenAIError(400, str(err.get("message", "bad request"))[:2000], param=err.get("param"))
            yield m
            continue
        run.ended = True
        run.h.metrics.instance_ended(ev.event)
        if ev.event != "completed":
            raise _failure(run.iid, ev)
        return


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


async def _collect(h: OpenAIHandler, req: OpenAIRequest, chat: bool, run: _Run) -> dict[str, Any]:
    start, first, choices, usage = time.perf_counter(), 0.0, [], {}
    try:
        async for m in _messages(run):
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


async def _stream(h: OpenAIHandler, req: OpenAIRequest, chat: bool, run: _Run,
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


async def _respond(h: OpenAIHandler, request: Request, chat: bool, tenant: str,
                   release: Callable[[], None]) -> Response:
    """Read, check and run one completion request; `release` is called once it has ended."""
    try:
        body = await read_body(request, h.max_body_bytes, h.read_timeout_s)
    except ClientDisconnect:
        release()
        return Response(status_code=400)  # nobody reads it
    req = parse_request(body, chat, h.max_tokens)
    return await _run_request(h, request, req, chat, tenant, release)


async def _checked(h: OpenAIHandler, req: OpenAIRequest, tenant: str = "local") -> OpenAIRequest:
    """The boundary checks that decode, fetch, compile or count (off the event loop): the images, the
    schemas, the prompt's budget."""
    if count_images(req.messages):
        assert h.facts is not None
        req = await resolve_images(req, h.images, h.facts.image_tokens, h.image_fetcher, tenant)
    await asyncio.to_thread(schema_problems, req)
    if h.budget is not None:
        req = await asyncio.to_thread(h.budget.check, req)
    return req


async def _run_request(h: OpenAIHandler, request: Request, req: OpenAIRequest, chat: bool, tenant: str,
                       release: Callable[[], None]) -> Response:
    """Check, launch and answer one validated chat or completions request."""
    req = await _checked(h, req, tenant)
    run = _launch(h, req, tenant)
    if req.stream:  # a handler's refusal then comes as the stream's error event (the status is sent)
        def close() -> None:
            run.close()
            release()
        return GuardedStream(_stream(h, req, chat, run, _messages(run)), h.write_timeout_s, close)
    return await _answer(request, _collect(h, req, chat, run), release)


async def _answer(request: Request, answer: Coroutine[Any, Any, dict[str, Any]],
                  release: Callable[[], None]) -> Response:
    """The non-streamed answer, unless the client goes away first (cancelling `answer` then terminates
    its instance); `release` is called once it has ended."""
    collect = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client went away: cancelling terminates the instance
            collect.cancel()
        release()
    with contextlib.suppress(asyncio.CancelledError):
        return JSONResponse(await collect)
    return Response(status_code=400)  # nobody reads it


# ---- /v1/responses (host/server/openai_responses.py has the conversions) ------------------------

_RESPONSES_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text"}


async def _respond_responses(h: OpenAIHandler, request: Request, tenant: str,
                             release: Callable[[], None]) -> Response:
    """Read, check and run one Responses request; `release` is called once it has ended."""
    try:
        raw = await read_body(request, h.max_body_bytes, h.read_timeout_s)
    except ClientDisconnect:
        release()
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
        req = await _checked(h, req, tenant)
    except OpenAIError as e:  # (an image's problem, a prompt too long: name the Responses parameter)
        if e.param == "messages":
            e.param, e.message = "input", "input" + e.message.removeprefix("messages")
        raise
    run = _launch(h, req, tenant)

    def store() -> None:
        if body.get("store", True) is not False:
            h.responses.put(builder.id, tenant, builder.conversation(kept))

    if req.stream:
        def close() -> None:
            run.close()
            release()
        return GuardedStream(_response_events(h, builder, run, _messages(run), store), h.write_timeout_s, close)
    return await _answer(request, _response_object(h, builder, run, store), release)


async def _response_object(h: OpenAIHandler, builder: ResponseBuilder, run: _Run,
                           store: Callable[[], None]) -> dict[str, Any]:
    start, first = time.perf_counter(), 0.0
    try:
        async for m in _messages(run):
            first = first or time.perf_counter() - start
            builder.feed(m)
    finally:  # also when cancelled (the client went away): terminates the instance
        run.close()
    builder.finish()
    store()
    _observe(h, start, first, builder.usage)
    return builder.object()


async def _response_events(h: OpenAIHandler, builder: ResponseBuilder, run: _Run,
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
    _observe(h, start, first, builder.usage)


def _observe(h: OpenAIHandler, start: float, first: float, usage: dict[str, Any] | None) -> None:
    u = usage or {}
    h.metrics.observe_request(first, time.perf_counter() - start, u.get("input_tokens", 0), u.get("output_tokens", 0))


# ---- /v1/embeddings (host/server/openai_embeddings.py has the request and the answer) -------------

async def _respond_embeddings(h: OpenAIHandler, request: Request, tenant: str,
                              release: Callable[[], None]) -> Response:
    """Read, check and run one embeddings request; `release` is called once it has ended."""
    try:
        raw = await read_body(request, h.max_body_bytes, h.read_timeout_s)
    except ClientDisconnect:
        release()
        return Response(status_code=400)  # nobody reads it
    req = parse_embeddings(load_body(raw))
    if h.embedding_program is None:
        raise OpenAIError(400, "this server serves no embeddings (pie-serve --embedding-handler none)",
                          param="model")
    if req.model != h.model:
        raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {h.model!r}",
                          param="model", code="model_not_found")
    f = h.facts or ModelFacts()
    await asyncio.to_thread(check_inputs, req, f.hidden_size, f.vocab_size, f.embed_tokens, f.count)
    run = _launch(h, req, tenant, h.embedding_program)
    return await _answer(request, _embeddings(req, run), release)


async def _embeddings(req: EmbeddingRequest, run: _Run) -> dict[str, Any]:
    vectors: dict[int, list[float]] = {}
    tokens = 0
    try:
        async for m in _messages(run):
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
        return await _respond(h, request, chat, tenant, release)
    return _endpoint(h, respond)


def _endpoint(h: OpenAIHandler, respond: Respond) -> Any:
    """A POST route that runs a handler instance: auth, the tenant's requests in progress, errors."""
    async def endpoint(request: Request) -> Response:
        try:
            tenant = _tenant(h, request)
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
