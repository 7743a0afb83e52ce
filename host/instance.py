"""One running inferlet: its store, thread, inbox, subscriptions, pages and forwards."""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import wasmtime
from wasmtime import Store, WasiConfig
from wasmtime import _ffi as ffi

from host.kv import PageTable
from host.scheduler import ForwardFuture

if TYPE_CHECKING:
    from host.runtime import Host

log = logging.getLogger(__name__)

TERMINAL_EVENTS = ("completed", "exception", "aborted", "out_of_resources")
_OUTPUT_TAIL = 4096

# Epoch deadline callback: wasmtime calls it (on the instance's thread) each time the guest's
# deadline passes, i.e. once per epoch tick while wasm code runs. It traps the guest when the
# instance was terminated or ran past its wall-clock budget, and otherwise extends the
# deadline by one tick. Lowering a deadline from another thread does not work: compiled code
# caches the deadline, so the callback is the only prompt way to stop a spinning guest.
_EPOCH_OWNERS: dict[int, Instance] = {}
_epoch_keys = itertools.count(1)
_EPOCH_CB_TYPE = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
                                  ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t))
_NO_FINALIZER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda _data: None)


def _trap(message: str) -> int:
    return ctypes.cast(ffi.wasmtime_error_new(message.encode("utf-8")), ctypes.c_void_p).value or 0


@_EPOCH_CB_TYPE
def _on_epoch(_ctx, data, delta, kind):  # type: ignore[no-untyped-def]
    inst = _EPOCH_OWNERS.get(data or 0)
    if inst is None:
        return _trap("instance is gone")
    if inst.stop_reason is not None:
        return _trap(f"instance terminated: {inst.stop_reason}")
    budget = inst.host.config.wall_budget_s
    if budget is not None and inst.elapsed_ms() > budget * 1000:
        inst.trap_reason = f"wall-clock budget of {budget:g} s exceeded"
        return _trap(inst.trap_reason)
    inst.host.gate.leave_if_long()  # a guest running for long lets the other instances run
    delta[0] = 1
    kind[0] = 0  # continue
    return 0


@dataclass(frozen=True)
class InstanceEvent:
    """Something an instance did: event is message|completed|exception|aborted|out_of_resources."""

    instance_id: str
    event: str
    message: str


class Terminated(Exception):
    """Raised inside a blocking import when the instance has been told to stop."""


class Instance:
    """State of one instance. Its thread runs the guest's `run` export to the end."""

    def __init__(self, host: Host, program: str, args: list[str],
                 on_event: Callable[[InstanceEvent], None]) -> None:
        self.id = str(uuid.uuid4())
        self.label = f"instance {self.id[:8]}"  # names its forward requests in backend errors
        self.host = host
        self.program = program
        self.args = list(args)
        self.on_event = on_event
        self.started_at = time.time()
        self._t0 = time.perf_counter()
        self.state = "starting"
        self.pages = PageTable(self.id)
        self.cond = threading.Condition()
        self._waiting = False  # the thread is blocked in wait_until (guarded by cond)
        self._handed = False  # the gate has woken it for its turn (guarded by cond)
        self.inbox: deque[str] = deque()
        self.input_closed = False
        self.published: deque[tuple[str, str]] = deque()
        self.topics: set[str] = set()
        self.forwards: dict[int, ForwardFuture] = {}
        self._next_handle = 1
        self.return_value: str | None = None
        self.trap_reason: str | None = None  # set by an import before it traps the guest
        self.stop_reason: str | None = None  # set by terminate()
        self.stop_event = "aborted"
        self._stderr = bytearray()
        self._epoch_key = 0
        self._thread = threading.Thread(target=self._main, name=f"inferlet-{self.id[:8]}", daemon=True)
        self.finished = threading.Event()

    # ---- lifecycle ----
    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the instance thread to end; True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def elapsed_ms(self) -> int:
        return int(1000 * (time.perf_counter() - self._t0))

    def emit(self, event: str, message: str) -> None:
        try:
            self.on_event(InstanceEvent(self.id, event, message))
        except Exception:  # a broken listener must not kill the instance thread
            log.exception("event listener failed for instance %s", self.id)

    def terminate(self, reason: str, event: str = "aborted") -> None:
        """Ask the instance to stop: running wasm traps at the next epoch check, waits wake up."""
        with self.cond:
            if self.stop_reason is not None or self.finished.is_set():
                return
            self.stop_reason = reason
            self.stop_event = event
            self.cond.notify_all()

    def check_alive(self) -> None:
        if self.stop_reason is not None:
            raise Terminated(self.stop_reason)

    def wait_until(self, ready: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Block (GIL released) until ready() or timeout; raises Terminated if stopped meanwhile."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        blocked = False
        try:
            with self.cond:
                while not ready():
                    self.check_alive()
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return False
                    if not blocked:
                        blocked = True
                        self.host.scheduler.forget(self.id)  # the scheduler need not wait for us
                        self._outside_cond(self.host.gate.leave)
                        continue  # cond was released: check again
                    self._waiting = True
                    self.cond.wait(remaining)
                    self._waiting = False
                    if self._handed:  # the gate woke us for our turn
                        self._handed = False
                        if not ready():  # not ready after all: pass the turn on
                            self._outside_cond(self.host.gate.declined)
                return True
        finally:
            if blocked:  # outside self.cond: the scheduler's wake-up callback needs it
                self.host.gate.enter()

    def _outside_cond(self, fn: Callable[[], None]) -> None:
        """Run `fn` with self.cond released: gate calls take other instances' conds."""
        self.cond.release()
        try:
            fn()
        finally:
            self.cond.acquire()

    def new_handle(self, fut: ForwardFuture) -> int:
        h = self._next_handle
        self._next_handle += 1
        self.forwards[h] = fut
        fut.add_done_callback(self.wake)
        return h

    def wake(self, _fut: ForwardFuture) -> None:
        """Done-callback of this instance's forwards: wake its thread (in its turn, see RunGate)."""
        self.host.gate.wake(self._notify)

    def _notify(self) -> bool:
        """The gate's wake-up: wake the thread if it waits; returns whether it was waiting."""
        with self.cond:
            if not self._waiting:
                return False
            self._handed = True
            self.cond.notify_all()
            return True

    def _capture_stdout(self, data: bytes) -> None:
        for line in data.decode("utf-8", "replace").splitlines():
            log.info("[%s] %s", self.id[:8], line)

    def _capture_stderr(self, data: bytes) -> None:
        self._stderr += data
        del self._stderr[:-_OUTPUT_TAIL]

    def _main(self) -> None:
        host = self.host
        event, message = "exception", "instance did not start"
        try:
            store = Store(host.wasm.engine)
            store.set_limits(memory_size=host.config.memory_limit_bytes)
            self._epoch_key = next(_epoch_keys)
            _EPOCH_OWNERS[self._epoch_key] = self
            ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), _on_epoch, self._epoch_key, _NO_FINALIZER)
            store.set_epoch_deadline(1)
            wasi = WasiConfig()
            wasi.stdout_custom = self._capture_stdout
            wasi.stderr_custom = self._capture_stderr
            store.set_wasi(wasi)
            self.check_alive()
            component = host.wasm.get(self.program)
            inst = host.linker.instantiate(store, component)
            run = inst.get_func(store, "run")
            if run is None:
                raise wasmtime.WasmtimeError("the component exports no `run` function")
            self.state = "running"
            host.bind_thread(self)
            result = run(store)
            if isinstance(result, str):
                event, message = "exception", f"inferlet returned an error: {result}"
            else:
                event, message = "completed", self.return_value or ""
        except wasmtime.WasmtimeError as e:
            event, message = self._classify_trap(e)
        except Terminated:
            event, message = self.stop_event, self.stop_reason or "terminated"
        except Exception as e:  # a host-side failure ends this instance only
            log.exception("instance %s failed in the host", self.id)
            event, message = "exception", f"host error: {type(e).__name__}: {e}"
        finally:
            host.gate.leave()
            host.unbind_thread()
            _EPOCH_OWNERS.pop(self._epoch_key, None)
            with self.cond:
                self.finished.set()
            self.state = event
            host.instance_ended(self)
        self.emit(event, message)

    def _classify_trap(self, e: wasmtime.WasmtimeError) -> tuple[str, str]:
        if self.stop_reason is not None:
            return self.stop_event, self.stop_reason
        if self.trap_reason is not None:
            return "exception", self.trap_reason
        text = str(e).strip()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        causes = [ln for ln in lines if "trap" in ln.lower() or "error" in ln.lower()]
        first = (causes[-1] if causes else lines[0]) if lines else "trap"
        stderr = self._stderr.decode("utf-8", "replace").strip()
        if "memory" in text.lower() or "MemoryError" in stderr:
            limit = self.host.config.memory_limit_bytes // 2**20
            first = f"{first} (linear memory limit is {limit} MiB)"
        detail = f"\n{stderr[-2000:]}" if stderr else ""
        return "exception", f"trap: {first}{detail}"
