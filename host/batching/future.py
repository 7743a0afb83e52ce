"""Completion of one queued job (a forward pass or a KV copy) and the copy job itself."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpu_backend.types import ForwardRequest

if TYPE_CHECKING:
    from host.batching.chunks import Chunks
    from host.batching.generation import Generation

__all__ = ["CopyRequest", "ForwardFuture", "Job"]

_FUTURE_LOCK = threading.Lock()  # guards a future's done flag against its lazily made Event


@dataclass(frozen=True)
class CopyRequest:
    """Copy the K/V of `count` tokens from `src_page[src_offset:]` to `dst_page[dst_offset:]`."""

    src_page: int
    src_offset: int
    dst_page: int
    dst_offset: int
    count: int
    name: str = ""


Job = ForwardRequest | CopyRequest


class ForwardFuture:
    """Completion of one job: `wait()` returns its result (a forward's outputs, None for a copy)
    or raises the error that failed it.

    The Event a blocking `wait()` needs is made only when someone blocks: instance threads
    wait on their own condition (woken by a done-callback), and finishing a batch is on the
    per-step critical path."""

    __slots__ = ("request", "owner", "generation", "follow", "submitted", "chunks", "parent", "priority", "tenant",
                 "_done", "_event", "_result", "_error", "_callbacks")

    def __init__(self, request: Job, owner: str, generation: Generation | None = None) -> None:
        self.request = request
        self.owner = owner
        self.generation = generation  # a host-side loop: the scheduler keeps its request in every batch
        # Set by the owner while it waits: called by the scheduler thread with the outputs when the
        # forward is done, before anyone wakes; it may return the owner's next forward (its pages
        # still pinned), which the scheduler queues at once. The scheduler clears it when it calls it.
        self.follow: Callable[[ForwardFuture, Any], ForwardFuture | None] | None = None
        self.submitted = time.perf_counter()
        # Chunked prefill (host/batching/chunks.py): a long forward's progress through its chunks
        # (set when its first chunk is taken); `parent`: this job is a chunk of that one, not its last.
        self.chunks: Chunks | None = None
        self.parent: ForwardFuture | None = None
        # its owner's service level when it was queued (host/levels.py): for the choice of a full batch
        self.priority = 0
        self.tenant = "local"
        self._done = False
        self._event: threading.Event | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[ForwardFuture], None]] = []

    def done(self) -> bool:
        return self._done

    def wait(self, timeout: float | None = None) -> Any:
        """The job's result; raises its error, or TimeoutError if not done within `timeout`."""
        if not self._done:
            with _FUTURE_LOCK:
                if not self._done and self._event is None:
                    self._event = threading.Event()
                event = self._event
            if not self._done and event is not None and not event.wait(timeout):
                raise TimeoutError("forward not finished")
        if self._error is not None:
            raise self._error
        return self._result

    def add_done_callback(self, fn: Callable[[ForwardFuture], None]) -> None:
        """Call `fn(self)` when done (at once if already done)."""
        self._callbacks.append(fn)
        if self._done:
            fn(self)

    def finish(self, result: Any, error: BaseException | None) -> None:
        """Complete the job (scheduler only): set the outcome, wake waiters, run callbacks."""
        self._result, self._error = result, error
        with _FUTURE_LOCK:
            self._done = True
            event = self._event
        if event is not None:
            event.set()
        for fn in list(self._callbacks):
            fn(self)
