"""One OpenAI request's handler instance: its launch, its events, its answer (`Run` and the steps
every route shares).

Invariant: a request's instance has ended (or been told to) when its route returns: a client that
goes away, streaming or not, or that stops reading an SSE stream for `write_timeout_s`, terminates
it, which frees its pages; its messages queued for the client are bounded (`max_queued_bytes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response

from host.events import InstanceEvent
from host.host import HostBusy
from host.server.http import read_body, until_disconnect
from host.server.openai_errors import OpenAIError
from host.server.openai_handler import OpenAIHandler
from host.server.openai_images import count_images, resolve_images
from host.server.openai_request import OpenAIRequest, schema_problems
from host.server.tenants import TenantLimitError

__all__ = ["Launchable", "Run", "answer", "checked", "handler_messages", "launch", "observe", "read_or_release"]

log = logging.getLogger(__name__)


class Launchable(Protocol):
    """A checked request a handler instance can run (`OpenAIRequest`, `EmbeddingRequest`)."""

    @property
    def model(self) -> str: ...

    @property
    def priority(self) -> int: ...

    def handler_argument(self) -> str:
        """The request as the handler's JSON argument."""


@dataclasses.dataclass
class Run:
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


async def read_or_release(h: OpenAIHandler, request: Request, release: Callable[[], None]) -> bytes | None:
    """The request's body, read within the handler's bounds; None (after `release`) when the client
    went away while sending it."""
    try:
        return await read_body(request, h.max_body_bytes, h.read_timeout_s)
    except ClientDisconnect:
        release()
        return None


def launch(h: OpenAIHandler, req: Launchable, tenant: str = "local",
            program: str | None = None) -> Run:
    """Launch `program` (default: the chat handler) with the request as its argument."""
    if req.model != h.model:
        raise OpenAIError(404, f"the model {req.model!r} does not exist; this server has {h.model!r}",
                          param="model", code="model_not_found")
    loop = asyncio.get_running_loop()
    run = Run(h, asyncio.Queue(), tenant, loop)
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


async def handler_messages(run: Run) -> AsyncIterator[dict[str, Any]]:
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


async def checked(h: OpenAIHandler, req: OpenAIRequest, tenant: str = "local") -> OpenAIRequest:
    """The boundary checks that decode, fetch, compile or count (off the event loop): the images, the
    schemas, the prompt's budget."""
    if count_images(req.messages):
        assert h.facts is not None
        req = await resolve_images(req, h.images, h.facts.image_tokens, h.image_fetcher, tenant)
    await asyncio.to_thread(schema_problems, req)
    if h.budget is not None:
        req = await asyncio.to_thread(h.budget.check, req)
    return req


async def answer(request: Request, answer: Coroutine[Any, Any, dict[str, Any]],
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


def observe(h: OpenAIHandler, start: float, first: float, usage: dict[str, Any] | None) -> None:
    u = usage or {}
    h.metrics.observe_request(first, time.perf_counter() - start, u.get("input_tokens", 0), u.get("output_tokens", 0))
