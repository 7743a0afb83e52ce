"""One running inferlet: its store, thread, inbox, subscriptions, pages and forwards; its start,
its launch when warm, and its end (how its thread blocks and wakes: host/wasm/waiting.py).

An instance sees the host only through its `InstanceEnv` (the engine, the linker, the run
gate, its limits and two callbacks), so it can be run and tested without a whole `Host`.
The WIT imports find the instance calling them with `current()` (each runs on its own thread).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import wasmtime
from wasmtime import Store, WasiConfig
from wasmtime.component import Func, Linker

from host.events import InstanceEvent
from host.state.pages import InstancePages
from host.state.topics import Mailbox
from host.wasm import priority, threads
from host.wasm.calling import calling, forget
from host.wasm.inbox import Inbox
from host.wasm.limits import InstanceLimits, unwatch_epochs, watch_epochs
from host.wasm.logs import InstanceLog
from host.wasm.starts import Starts
from host.wasm.traps import explain_trap, memory_note
from host.wasm.waiting import Waiter

if TYPE_CHECKING:
    from host.batching.future import ForwardFuture
    from host.batching.gate import RunGate
    from host.replay.recorder import Recorder
    from host.wasm.engine import WasmEngine

__all__ = ["Instance", "InstanceEnv", "Terminated", "current"]

log = logging.getLogger(__name__)

_OUTPUT_TAIL = 4096


def current(park: bool = True) -> Instance:
    """The instance whose thread is calling (for the WIT imports). A warm instance that has not
    been launched yet waits here, at its first host call, until it is (see `Instance.warm`);
    `park` False: an import whose answer is the same for every launch (the model's constants) is
    answered before the launch, and the instance parks at its first call of another import."""
    inst: Instance | None = getattr(calling, "instance", None)
    if inst is None:
        raise wasmtime.WasmtimeError("host import called outside an inferlet thread")
    if park and inst.parked:
        inst.await_launch()
    return inst


@dataclass(frozen=True)
class InstanceEnv:
    """What an instance needs from its host, and nothing more."""

    engine: WasmEngine
    linker: Linker
    gate: RunGate
    limits: InstanceLimits
    on_block: Callable[[str], None]  # the instance blocks on something other than a forward
    on_end: Callable[[Instance], None]  # the instance thread ends: release what it held
    # a warm instance starts at the lowest CPU priority until launched (host/wasm/priority.py)
    warm_in_background: bool = False
    starts: Starts | None = None  # counts launched instances until their first wait
    # a warm instance calls it before it makes its store (an instance worker: host/workers/worker.py)
    before_warm_store: Callable[[], None] | None = None


class Terminated(Exception):
    """Raised inside a blocking import when the instance has been told to stop."""


class StepLookahead(Protocol):
    """What the instance keeps for a guest stepping every token (host/api/lookahead.py's `Stepper`)."""

    def drop(self) -> None:
        """Forget the predicted next step (withdrawn if still queued)."""

    def close(self) -> ForwardFuture | None:
        """At the instance's end: drop the prediction; a running one's future, to wait for."""


class Instance(Waiter):
    """State of one instance. Its thread runs the guest's `run` export to the end.

    A *warm* instance (`warm=True`, made ahead of demand by host/wasm/warm.py) is started before
    anyone launches it: its store is made, its component instantiated and its guest run up to its
    first host call (other than the model's constants, `current(park=False)`), where it waits
    (`parked`) until `launch` gives it its arguments, listener and tenant. Until then the guest has
    received nothing from the host that differs between launches, so it cannot tell a warm start
    from a cold one; its wall-clock budget starts at `launch`. With
    `InstanceEnv.warm_in_background`, its thread runs at the lowest CPU priority until `launch`
    raises it back (host/wasm/priority.py). A warm instance must
    reach its first call within `WARM_DEADLINE_S` of its thread's CPU time, or it is stopped: a
    thread at the lowest priority may wait seconds for a core while a burst runs, and only a
    guest that computes that long before its first call is one not to warm.
    """

    WARM_DEADLINE_S = 2.0

    def __init__(self, env: InstanceEnv, program: str, args: list[str],
                 on_event: Callable[[InstanceEvent], None], warm: bool = False) -> None:
        super().__init__(env.gate)
        self.id = str(uuid.uuid4())
        self.label = f"instance {self.id[:8]}"  # names its forward requests in backend errors
        self.env = env
        self.program = program
        self.args = list(args)
        self.on_event = on_event
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        self.state = "starting"
        self.pages = InstancePages(self.id)
        self.inbox = Inbox(env.limits.max_inbox_bytes)  # unread client messages (guarded by cond)
        self.input_closed = False
        self.published = Mailbox(env.limits.max_published_messages, env.limits.max_published_bytes)
        self.topics: set[str] = set()
        self.forwards: dict[int, ForwardFuture] = {}
        self._next_handle = 1
        self.wasi_helper: Func | None = None  # host/api/wasi.py's helper in this instance's store, once made
        self.stepper: StepLookahead | None = None  # host/api/lookahead.py's Stepper, once the guest steps
        self.recorder: Recorder | None = None  # records its host calls (host/replay/recorder.py)
        self.return_value: str | None = None
        self.trap_reason: str | None = None  # set by an import before it traps the guest
        self.stop_reason: str | None = None  # set by terminate()
        self.stop_event = "aborted"
        self._stderr = bytearray()
        self.log = InstanceLog()  # runtime.log, stdout and stderr lines (host/wasm/logs.py)
        self.ended_at: float | None = None  # time.time() when it ended
        self._job: threads.Job | None = None  # its thread's run of `_main` (host/wasm/threads.py), once started
        self.finished = threading.Event()
        self._thread_started = threading.Event()  # `start` has started its thread
        self.parked = warm  # not launched yet: the first host call waits (guarded by cond)
        self.at_first_call = False  # a warm instance has reached its first host call
        self._awaiting_launch = False  # a warm instance's thread waits in await_launch (guarded by cond)
        self._resumed = False  # the gate has handed a launched warm instance its turn (guarded by cond)
        self._base_nice: int | None = None  # while a warm instance's thread runs in the background (guarded by cond)
        self._starting = False  # counted in env.starts: launched, not waited yet (guarded by cond)
        self._cpu0 = 0.0  # its thread's CPU time when it began (time.thread_time, read on that thread)
        # it ended for the host's reasons, not its guest's (a host error, the instance pool full)
        self.failed_in_host = False
        self._store: Store | None = None  # its guest's store, from `_run` until freed at the end
        self._epoch_key = 0  # its store's entry in the epoch watch (host/wasm/limits.py)

    def launch(self, args: list[str], on_event: Callable[[InstanceEvent], None], tenant: str) -> bool:
        """Hand a warm instance its launch; False if it can no longer be used (it ended or was stopped)."""
        with self.cond:
            if not self.parked or self.finished.is_set() or self.stop_reason is not None:
                return False
            self.args = list(args)
            self.on_event = on_event
            self.pages.tenant = tenant
            self.started_at = time.time()
            self._t0 = time.perf_counter()
            self.parked = False
            self._begin_start()
            self.to_foreground()
        # Its thread is woken in its turn, like an instance whose forward is done: woken at once,
        # a burst of launches had every parked thread take the GIL only to queue for a gate slot
        # (host/batching/gate.py).
        self.env.gate.wake(self._resume)
        return True

    def to_foreground(self) -> None:
        """A warm instance launched: from now on it serves a client, at its thread's priority before
        it was lowered (`InstanceEnv.warm_in_background`). Called with `cond` held."""
        if self._base_nice is not None:
            try:
                priority.restore(self._job.native_id if self._job is not None else 0, self._base_nice)
            except OSError as e:  # (permitted when probed: only a policy change gets here)
                log.warning("%s keeps its background priority: %s", self.label, e)
            self._base_nice = None

    def _resume(self) -> bool:
        """The gate's wake-up for a launched warm instance; returns whether its thread was waiting."""
        with self.cond:
            if not self._awaiting_launch:
                return False
            self._awaiting_launch = False
            self._resumed = True
            kick = self._waiting
            self._waiting = False
        if kick:
            self._kick.release()  # outside cond, as `_notify`
        return True

    def await_launch(self) -> None:
        """A warm instance at its first host call: wait until launched; Terminated if stopped first."""
        with self.cond:
            self.at_first_call = True
            self.state = "warm"
            self.cond.notify_all()  # the pool may be waiting for it to get here
            self._awaiting_launch = True
            while not self._resumed and self.stop_reason is None:  # on the kick, as wait_until
                self._waiting = True
                self.cond.release()
                try:
                    self._kick.acquire()
                finally:
                    self.cond.acquire()
                self._waiting = False
            self._awaiting_launch = False
            if self.stop_reason is not None:
                if self._resumed:  # handed a turn it will not take
                    self._outside_cond(self.env.gate.declined)
                raise Terminated(self.stop_reason)
            self.state = "running"
        self.env.gate.enter()  # the turn the gate handed it

    # ---- lifecycle ----
    def start(self) -> None:
        if not self.parked:  # a cold launch starts on the critical path
            with self.cond:
                self._begin_start()
        self._job = threads.run(self._main, f"inferlet-{self.id[:8]}")
        self._thread_started.set()

    def fail_to_start(self, message: str) -> None:
        """Its thread could not be started: end it with an exception event, as its thread would."""
        self._end_start()
        self._thread_started.set()
        self._mark_ended("exception")
        self.emit("exception", message)

    def _mark_ended(self, event: str) -> None:
        """Finished: waiters see it, and the host releases what it held (on_end)."""
        with self.cond:
            self.finished.set()
            self.cond.notify_all()
        self.state = event
        self.env.on_end(self)

    def _begin_start(self) -> None:
        """Count this instance as starting (cond held)."""
        if self.env.starts is not None and not self._starting:
            self._starting = True
            self.env.starts.begin()

    def _end_start(self) -> None:
        """It waits for the first time, or ends: no longer starting."""
        with self.cond:
            if not self._starting:
                return
            self._starting = False
        assert self.env.starts is not None
        self.env.starts.done()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the instance thread to end (to be started first, if it is queued for that,
        host/wasm/starter.py); True if it has."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._thread_started.wait(timeout):
            return False
        if self._job is None:  # (fail_to_start: no thread ever ran)
            return self.finished.is_set()
        return self._job.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))

    def elapsed_ms(self) -> int:
        return int(1000 * (time.perf_counter() - self._t0))

    def emit(self, event: str, message: str, stream: str = "") -> None:
        try:
            self.on_event(InstanceEvent(self.id, event, message, stream))
        except Exception:  # a broken listener must not kill the instance thread
            log.exception("event listener failed for instance %s", self.id)

    def log_line(self, stream: str, text: str) -> None:
        """A line of the guest's `runtime.log` or output: kept in its log, streamed as a `log` event."""
        shown = self.log.add(stream, text)
        if shown is not None:
            self.emit("log", shown, stream)

    def terminate(self, reason: str, event: str = "aborted") -> None:
        """Ask the instance to stop: running wasm traps at the next epoch check, waits wake up."""
        with self.cond:
            if self.stop_reason is not None or self.finished.is_set():
                return
            self.stop_reason = reason
            self.stop_event = event
            self._wake_all()

    def on_epoch(self) -> str | None:
        """Epoch tick while the guest runs: a trap message if it must stop, else None."""
        if self.parked and time.thread_time() - self._cpu0 > self.WARM_DEADLINE_S:  # (on its own thread)
            self.terminate(f"did not reach its first host call within {self.WARM_DEADLINE_S:g} s while warming")
        self._enforce_budget()
        if self.stop_reason is not None:
            return f"instance terminated: {self.stop_reason}"
        self.env.gate.leave_if_long()  # a guest running for long lets the other instances run
        return None

    def budget_left_s(self) -> float | None:
        """Seconds left of the wall-clock budget (may be negative); None if it has none."""
        budget = self.env.limits.wall_budget_s
        if budget is None or self.parked:  # a warm instance's budget starts at its launch
            return None
        return budget - (time.perf_counter() - self._t0)

    def _enforce_budget(self) -> None:
        """Past its budget, the instance is stopped like a terminate, ending as an exception."""
        left = self.budget_left_s()
        if left is not None and left <= 0 and self.stop_reason is None:
            self.terminate(f"wall-clock budget of {self.env.limits.wall_budget_s:g} s exceeded", "exception")

    def deliver(self, topic: str, message: str) -> None:
        """A message published on a topic this instance subscribed to."""
        with self.cond:
            self.published.put(topic, message)
            self._wake_all()

    def signal(self, message: str) -> None:
        """A client message for the guest's receive(); InboxFull past `max_inbox_bytes` unread."""
        with self.cond:
            if self.finished.is_set():
                return  # nobody will read it
            self.inbox.put(message, self.id)
            self._wake_all()

    def take_message(self) -> str | None:
        """The oldest unread client message, or None (cond held by the caller or not)."""
        with self.cond:
            return self.inbox.take()

    def drop_inbox(self) -> None:
        """The instance has ended: its unread messages go."""
        with self.cond:
            self.inbox.clear()

    def close_input(self) -> None:
        """From now on receive() returns none once the inbox is empty."""
        with self.cond:
            self.input_closed = True
            self._wake_all()

    def check_alive(self) -> None:
        """Raise Terminated if the instance was told to stop or has run past its wall-clock budget."""
        self._enforce_budget()
        if self.stop_reason is not None:
            raise Terminated(self.stop_reason)

    def _blocking(self) -> None:
        """About to block: no longer starting, and the scheduler need not wait for this instance."""
        if self._starting:
            self._end_start()
        self.env.on_block(self.id)

    def new_handle(self, fut: ForwardFuture) -> int:
        h = self._next_handle
        self._next_handle += 1
        self.forwards[h] = fut
        fut.add_done_callback(self.wake)
        return h

    def _capture_stdout(self, data: bytes) -> None:
        for line in self.log.write("stdout", data):
            self.log_line("stdout", line)

    def _capture_stderr(self, data: bytes) -> None:
        self._stderr += data
        del self._stderr[:-_OUTPUT_TAIL]
        for line in self.log.write("stderr", data):
            self.log_line("stderr", line)

    def _main(self) -> None:
        """The instance's thread: run the guest (`_run`), then end with exactly one terminal event,
        after everything it held here is released (`_release`, `Host._instance_ended`)."""
        event, message = "exception", "instance did not start"
        try:
            event, message = self._run()
        except wasmtime.WasmtimeError as e:
            event, message = self._classify_trap(e)
        except Terminated:
            event, message = self.stop_event, self.stop_reason or "terminated"
        except Exception as e:  # a host-side failure ends this instance only
            log.exception("instance %s failed in the host", self.id)
            self.failed_in_host = True
            event, message = "exception", f"host error: {type(e).__name__}: {e}"
        finally:
            self._end_start()
            self.env.gate.leave()
            forget()  # (the thread runs another instance next: host/wasm/threads.py)
            self._release()
            for stream, line in self.log.flush():  # a last line with no newline
                self.log_line(stream, line)
            self.ended_at = time.time()
            self._mark_ended(event)
        self.emit(event, message)
        store, self._store = self._store, None
        if store is not None:  # freed off this thread, when the backend is idle (host/wasm/reaper.py)
            self.env.engine.free_store(store)

    def _run(self) -> tuple[str, str]:
        """Make the store, instantiate the component and run the guest here; its end (event, message)."""
        env = self.env
        self._cpu0 = time.thread_time()
        with self.cond:  # (not once launched: `launch` raises it only after this)
            warm = self.parked
            if warm and env.warm_in_background:
                self._base_nice = priority.lower()
        if warm and env.before_warm_store is not None:
            env.before_warm_store()
        store = self._store = env.engine.new_store()
        env.limits.apply(store)
        self._epoch_key = watch_epochs(store, self)
        wasi = WasiConfig()
        wasi.stdout_custom = self._capture_stdout
        wasi.stderr_custom = self._capture_stderr
        store.set_wasi(wasi)
        self.check_alive()
        inst = env.linker.instantiate(store, env.engine.get(self.program))
        run = inst.get_func(store, "run")
        if run is None:
            raise wasmtime.WasmtimeError("the component exports no `run` function")
        self.state = "warm" if self.parked else "running"
        calling.instance = self
        result = run(store)
        if isinstance(result, str):
            return "exception", f"inferlet returned an error: {result}{memory_note(result, self.env.limits)}"
        return "completed", self.return_value or ""

    def _release(self) -> None:
        """The guest has ended: stop watching its store's epochs."""
        unwatch_epochs(self._epoch_key)

    def _classify_trap(self, e: wasmtime.WasmtimeError) -> tuple[str, str]:
        """The end event of a guest that trapped: the host's own reason if it stopped the guest,
        else its trap explained (host/wasm/traps.py)."""
        if self.stop_reason is not None:
            return self.stop_event, self.stop_reason
        if self.trap_reason is not None:
            return "exception", self.trap_reason
        pool = self.env.engine.pooling
        message, host_fault = explain_trap(str(e), self.env.limits, pool, self._stderr.decode("utf-8", "replace"))
        self.failed_in_host = self.failed_in_host or host_fault
        return "exception", message
