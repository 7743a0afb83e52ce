"""Which connection owns each instance, and the events held for detached instances.

An instance belongs to the connection that launched it, and to that connection's tenant; a
disconnect terminates it unless it was launched detached. Another tenant's instance is "unknown"
to a connection (only the admin identity sees and attaches every tenant's instances). A detached
instance with no connection attached buffers its events (up to `event_buffer_limit` events and
`event_buffer_bytes`, oldest dropped, the last one always kept) until a connection attaches.
Invariants: a record stays in the table until its terminal event was delivered, or, finished
detached and never attached, until more than MAX_FINISHED_DETACHED such records exist or their
buffers pass FINISHED_DETACHED_BUFFERS times one buffer's bound; while a
record has buffered events, new ones queue behind them, so attach keeps the order. Every method
runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from host.client import protocol as p
from host.events import TERMINAL_EVENTS, InstanceEvent
from host.server.connection import Connection, RequestError
from host.server.tenants import TenantLimits

__all__ = ["InstanceRecord", "InstanceTable", "MAX_FINISHED_DETACHED"]

log = logging.getLogger(__name__)

MAX_FINISHED_DETACHED = 1024
# Finished detached instances nobody attached to keep at most this many times one instance's
# buffer bound, all together (oldest forgotten first).
FINISHED_DETACHED_BUFFERS = 16


@dataclass(eq=False)
class InstanceRecord:
    """The server's view of one instance: its owner and the event frames held for it."""

    program: str
    detached: bool
    owner: Connection | None
    id: str = ""
    tenant: str = "local"  # counted in TenantLimits.instances until its terminal event
    finished: bool = False
    buffer: deque[bytes] = field(default_factory=deque)
    buffered_bytes: int = 0  # of the frames in `buffer`
    dropped: int = 0
    # bytes of events handed to the event loop and not yet taken (`InstanceTable.sink`): the
    # instance's thread waits while they pass the buffer bound, so a guest that emits faster than
    # the loop takes its events cannot pile them up in the loop's queue
    in_flight: int = 0
    flow: threading.Condition = field(default_factory=threading.Condition)


class InstanceTable:
    """The server's instances by id. `terminate(iid, reason)` is the host's; `on_end(event)` is
    told how each instance ended."""

    def __init__(self, terminate: Callable[[str, str], None], event_buffer_limit: int,
                 on_end: Callable[[str], None] | None = None, limits: TenantLimits | None = None,
                 event_buffer_bytes: int = 16 * 2**20) -> None:
        self.records: dict[str, InstanceRecord] = {}
        self._buffer_bytes = event_buffer_bytes
        self.limits = limits  # told when each instance ends (its tenant's running count)
        self._terminate = terminate
        self._on_end = on_end  # called with each terminal event's name (metrics)
        self._buffer_limit = event_buffer_limit
        self._finished_detached: deque[str] = deque()

    def __len__(self) -> int:
        return len(self.records)

    def get(self, iid: str) -> InstanceRecord | None:
        return self.records.get(iid)

    def add(self, record: InstanceRecord) -> None:
        """Track a launched instance (`record.id` set) for its owner."""
        self.records[record.id] = record
        if record.owner is not None:
            record.owner.instances.add(record.id)

    def visible(self, conn: Connection, iid: str) -> InstanceRecord | None:
        """The record of `iid` if `conn`'s tenant may know of it (its own, or any for the admin)."""
        record = self.records.get(iid)
        if record is None or (record.tenant != conn.tenant and not conn.admin):
            return None
        return record

    def owned(self, conn: Connection, kind: str, iid: str) -> InstanceRecord:
        """The running instance `iid` if `conn` owns it; else RequestError naming request `kind`."""
        record = self.visible(conn, iid)
        if record is None or record.finished:
            raise RequestError(f"{kind}: unknown or finished instance {iid!r}")
        if record.owner is not conn:
            hint = "; attach_instance first" if record.detached and record.owner is None else ""
            raise RequestError(f"{kind}: instance {iid} is not attached to this connection{hint}")
        return record

    def attach(self, conn: Connection, iid: str) -> InstanceRecord | None:
        """Give a detached, unattached instance to `conn`; None if `conn` has it already.

        The caller sends the buffered events with `flush` after the attach response.
        """
        record = self.visible(conn, iid)
        if record is None:
            raise RequestError(f"attach_instance: unknown instance {iid!r}")
        if record.owner is conn:
            return None
        if record.owner is not None:
            raise RequestError(f"attach_instance: instance {iid} is attached to another connection")
        if not record.detached:
            raise RequestError(f"attach_instance: instance {iid} was not launched detached")
        record.owner = conn
        conn.instances.add(record.id)
        return record

    def sink(self, record: InstanceRecord, loop: asyncio.AbstractEventLoop) -> Callable[[InstanceEvent], None]:
        """The `on_event` to launch `record`'s instance with: hands each event to `loop`."""

        def on_event(event: InstanceEvent) -> None:  # runs on the instance's thread
            size = len(event.message)
            with record.flow:  # (a terminal event never waits: it ends the flow)
                while (record.in_flight and record.in_flight + size > self._buffer_bytes
                       and event.event not in TERMINAL_EVENTS and not loop.is_closed()):
                    record.flow.wait(0.1)
                record.in_flight += size
            try:
                loop.call_soon_threadsafe(taken, event, size)
            except RuntimeError:  # loop closed: the server has stopped, nobody can receive it
                log.debug("dropping %s event of %s: server stopped", event.event, event.instance_id)

        def taken(event: InstanceEvent, size: int) -> None:  # on the loop
            with record.flow:
                record.in_flight -= size
                record.flow.notify_all()
            self.on_event(record, event)

        return on_event

    def on_event(self, record: InstanceRecord, event: InstanceEvent) -> None:
        """Send the event to the owner, or buffer it; forget the record once it is delivered."""
        frame = p.encode_event(event.instance_id, event.event, event.message, event.stream)
        owner = record.owner
        if owner is not None and not record.buffer:
            owner.send(frame)
        elif owner is not None or record.detached:
            record.buffer.append(frame)
            record.buffered_bytes += len(frame)
            while len(record.buffer) > 1 and (len(record.buffer) > self._buffer_limit
                                              or record.buffered_bytes > self._buffer_bytes):
                record.buffered_bytes -= len(record.buffer.popleft())
                record.dropped += 1
        if event.event in TERMINAL_EVENTS:
            record.finished = True
            if self.limits is not None:
                self.limits.give_instance(record.tenant)
            if self._on_end is not None:
                self._on_end(event.event)
            if owner is None and record.detached:
                self._finished_detached.append(record.id)
                self._evict_finished_detached()
            elif owner is None or not record.buffer:
                self._forget(record)

    def flush(self, record: InstanceRecord) -> None:
        """Send the buffered events to the owner that just attached."""
        owner = record.owner
        if owner is None:
            return
        if record.dropped:
            log.warning("instance %s: %d buffered events were dropped before attach", record.id, record.dropped)
        while record.buffer:
            owner.send(record.buffer.popleft())
        record.buffered_bytes = 0
        if record.finished:
            self._forget(record)

    def release(self, conn: Connection) -> None:
        """The connection is gone: detach its detached instances, terminate the others."""
        for iid in conn.instances:
            record = self.records.get(iid)
            if record is None or record.owner is not conn:
                continue
            record.owner = None
            if record.finished:
                self._forget(record)
            elif not record.detached:
                self.terminate_quietly(iid, "client disconnected")
        conn.instances.clear()

    def terminate_all(self, reason: str) -> None:
        """Terminate every instance still running (the server is stopping)."""
        for record in list(self.records.values()):
            if not record.finished:
                self.terminate_quietly(record.id, reason)

    def terminate_quietly(self, iid: str, reason: str) -> None:
        """Terminate `iid` unless it has already ended."""
        try:
            self._terminate(iid, reason)
        except KeyError:
            log.debug("instance %s already ended before terminate(%r)", iid, reason)

    def _forget(self, record: InstanceRecord) -> None:
        self.records.pop(record.id, None)
        if record.owner is not None:
            record.owner.instances.discard(record.id)

    def _evict_finished_detached(self) -> None:
        # Finished detached instances nobody attached to are kept (for their events) up to a
        # count and up to a total of buffered bytes, the oldest forgotten first.
        kept = [r for r in (self.records.get(i) for i in self._finished_detached) if r is not None]
        total = sum(r.buffered_bytes for r in kept)
        while self._finished_detached and (len(self._finished_detached) > MAX_FINISHED_DETACHED
                                           or total > FINISHED_DETACHED_BUFFERS * self._buffer_bytes):
            record = self.records.get(self._finished_detached.popleft())
            if record is not None and record.owner is None:
                total -= record.buffered_bytes
                log.info("forgetting finished detached instance %s: nobody attached to take its events", record.id)
                self._forget(record)
