"""`RemoteInstance`: an instance whose guest runs in one of the host's worker processes
(host/workers/pool.py starts them, host/workers/worker.py is their side). Its thread here serves the
guest's host calls one at a time, with the same import functions as an in-process instance's; a
stepping guest's `decode-step`, and the calls an import can begin without waiting (its `begin`:
`runtime.arguments`, `forward.generate-fresh`, `forward.generate`, `kv.release`), are served on the
worker's reader thread instead (`serve_now`), and answered from its answering thread. A cold
launch's thread starts only when something needs it (`start`, `to_thread`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import wasmtime

from host.api.guest import WOULD_WAIT, Begun, as_trap
from host.api.lookahead import Stepper
from host.batching.future import ForwardFuture
from host.events import TERMINAL_EVENTS, InstanceEvent
from host.wasm import threads
from host.wasm.calling import calling
from host.wasm.instance import Instance, InstanceEnv, Terminated
from host.workers import wire

__all__ = ["RemoteInstance", "WorkerLost", "encode_reply"]

log = logging.getLogger(__name__)

_STEP = "forward.decode-step"  # served on the reader thread when it can be (`RemoteInstance.serve_now`)


class WorkerLink(Protocol):
    """The worker process an instance's guest runs in, as the instance uses it (host/workers/pool.py)."""

    def send(self, msg: Any) -> None:
        """Send one wire message."""

    def write(self, datas: list[bytes]) -> None:
        """Send encoded messages, in one write."""

    def answer(self, fn: Callable[[], wire.Reply | None]) -> None:
        """Make an answer with `fn` on the worker's answering thread, and send it."""


class Placement(Protocol):
    """The worker pool, as its instances use it (host/workers/pool.py's `WorkerPool`)."""

    imports: dict[str, Callable[..., Any]]

    def place(self, inst: RemoteInstance) -> WorkerLink:
        """Put `inst` on a worker and launch its guest there."""

    def release(self, inst: RemoteInstance) -> None:
        """`inst` has ended: its worker no longer counts it."""


@dataclass(frozen=True)
class WorkerLost:
    """The instance's worker died: its guest is gone."""

    reason: str


@dataclass(slots=True)
class _Finish:
    """A call begun on the reader whose answer must wait (`Begun.finish`): the instance's thread makes it."""

    call: wire.Call
    begun: Begun


@dataclass(slots=True)
class _Fast:
    """A call served on the reader and not answered yet: its job, and what ends it if the instance is terminated."""

    name: str
    fut: ForwardFuture
    abort: Callable[[], None]


def encode_reply(reply: wire.Reply) -> bytes:
    """`reply` as bytes; a result that cannot cross (a host bug) becomes the guest's trap."""
    try:
        return wire.dumps(reply)
    except wire.WireError as e:
        log.error("the result of a host call of instance %s cannot cross to its worker: %s", reply.iid[:8], e)
        return wire.dumps(wire.Reply(reply.iid, trap=f"internal host error: {e}"))


class RemoteInstance(Instance):
    """An instance whose guest runs in a worker process (host/workers/worker.py): its thread here
    serves the guest's host calls, one at a time, and ends with the guest. Everything else (its
    pages, forwards, inbox, subscriptions, events, terminate, the wall budget, a warm instance's
    parking at its first call) is an `Instance`'s."""

    def __init__(self, env: InstanceEnv, program: str, args: list[str],
                 on_event: Callable[[InstanceEvent], None], warm: bool = False,
                 pool: Placement | None = None) -> None:
        super().__init__(env, program, args, on_event, warm)
        if pool is None:
            raise ValueError("a RemoteInstance needs a WorkerPool")
        self.pool = pool
        self.worker: WorkerLink | None = None
        self.inbound: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.deferred_trap: str | None = None  # a one-way call failed: the guest traps at its next call
        self._worker_unparked = not warm  # its worker knows it was launched (guarded by cond)
        # Calls put in `inbound` (counted by the worker's reader thread) and of those served by this
        # instance's thread (counted by it): equal when it has none to serve.
        self.queued = 0
        self.served = 0
        self._fast_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._fast: _Fast | None = None  # a call served on the reader, not answered (`serve_now`)

    def terminate(self, reason: str, event: str = "aborted") -> None:
        first = self.stop_reason is None and not self.finished.is_set()
        super().terminate(reason, event)
        with self._fast_lock:  # (after stop_reason is set: `serve_now` answers a call it starts after this)
            fast, self._fast = self._fast, None
        if fast is not None:  # a call served on the reader: its answer is the trap, now
            fast.abort()
            self._reply(wire.Reply(self.id, trap=f"{fast.name}: instance terminated: {self.stop_reason}"))
        worker = self.worker
        if first and worker is not None:  # a guest computing traps at its worker's next epoch check
            try:
                worker.send(wire.Stop(self.id, reason))
            except (OSError, ValueError):  # the worker is gone: its end comes as WorkerLost
                pass

    def start(self) -> None:
        """A cold launch is placed on its worker from here (the starter's thread) and its thread here
        is started only once there is something for it (`to_thread`): a call the reader thread cannot
        serve, or the guest's end. A completion whose calls are all served on the reader (see
        `serve_now`) then wakes a thread here once, at its end, instead of at its start, at each
        call and at its end. A warm instance (placed while it warms) starts its thread at once."""
        if self.parked:
            super().start()
            return
        with self.cond:
            self._begin_start()
        if self.stop_reason is None:
            try:
                self._place()
            except Exception:  # (the host's workers are shut down: the thread ends it, as for any start)
                log.debug("placing %s failed", self.label, exc_info=True)
        if self.worker is None or self.stop_reason is not None:
            self._start_thread()

    def _start_thread(self) -> None:
        """Start the instance's thread (`_main`), once."""
        with self._start_lock:
            if self._job is not None:
                return
            self._job = threads.run(self._main, f"inferlet-{self.id[:8]}")
        self._thread_started.set()

    def to_thread(self, msg: Any) -> None:
        """Hand `msg` to the instance's thread, starting it if it waits for its first message."""
        self.inbound.put(msg)
        if self._job is None:
            try:
                self._start_thread()
            except Exception as e:  # (no thread left in the process): this instance ends, the host goes on
                log.exception("could not start the thread of %s", self.label)
                reason = f"host error: could not start the instance's thread: {e}"
                self.terminate(reason, "exception")  # (its guest is stopped in its worker, its loop cancelled)
                self._release()
                self.fail_to_start(reason)  # (its pages go back as for any end)

    def _place(self) -> None:
        """Launch the guest in a worker (stopping it there if it was terminated meanwhile)."""
        self.state = "warm" if self.parked else "running"  # (before its Launch: its end may come at once)
        self.pool.place(self)
        if self.stop_reason is not None and self.worker is not None:  # terminated while placed
            try:  # (its own Stop may have found no worker yet)
                self.worker.send(wire.Stop(self.id, self.stop_reason))
            except (OSError, ValueError):  # the worker is gone: its end comes as WorkerLost
                pass

    def launch(self, args: list[str], on_event: Callable[[InstanceEvent], None], tenant: str) -> bool:
        if not super().launch(args, on_event, tenant):
            return False
        if not self.at_first_call:  # (parked at its first call: its thread tells the worker, off this one)
            self._unpark_worker()
        return True

    def _unpark_worker(self) -> None:
        """Tell the worker, once, that this warm instance was launched (its arguments with it)."""
        with self.cond:
            worker = self.worker
            if self._worker_unparked or self.parked or worker is None:
                return  # (not placed yet: its Launch, sent after, says it is not warm)
            self._worker_unparked = True
        try:
            worker.send(wire.Unpark(self.id, tuple(self.args)))
        except (OSError, ValueError):
            pass

    def on_epoch(self) -> str | None:
        """The host's epoch tick (the worker checks the guest's own): the wall budget."""
        self._enforce_budget()
        return None

    def _run(self) -> tuple[str, str]:
        """Launch the guest in a worker and serve its host calls until it ends there."""
        calling.instance = self
        if self.worker is None:  # (not placed by `start`)
            self.check_alive()  # (terminated before it started: ends at once, as in-process)
            self._place()
        while True:
            msg = self.inbound.get()
            if isinstance(msg, (wire.Call, _Finish)):
                reply = self._serve(msg) if isinstance(msg, wire.Call) else self._finish(msg)
                self.served += 1  # (before the answer: the guest's next call may be served on the reader)
                if reply is not None:
                    self._reply(reply)
            elif isinstance(msg, wire.Ended):
                event, message = msg.event, msg.message
                if event not in TERMINAL_EVENTS:  # (the worker classifies as Instance does)
                    event, message = "exception", f"the worker ended the instance with {event!r}: {message}"
                break
            elif isinstance(msg, WorkerLost):
                self.failed_in_host = True
                event, message = "exception", msg.reason
                break
        if self.stop_reason is not None:  # the host's reason wins over how the worker saw the end
            return self.stop_event, self.stop_reason
        if self.deferred_trap is not None and event == "completed":  # it ended before its next call
            return "exception", self.deferred_trap
        if event == "completed":  # (its return value was set in the worker, or here while it was parked)
            return event, message or self.return_value or ""
        return event, message

    def _release(self) -> None:
        self.pool.release(self)

    def _serve(self, call: wire.Call) -> wire.Reply | None:
        """Run one import the guest called, as its own thread would in-process; its answer (a
        one-way call: none; its trap, if it fails, is the answer to the guest's next call)."""
        if self.deferred_trap is not None:  # the guest is past a failed one-way call: it traps now
            return None if call.oneway else wire.Reply(self.id, trap=self.deferred_trap)
        fn = self.pool.imports.get(call.name)
        # The run gate as in-process: an import that blocks gives its slot up and takes one when it
        # goes on (Instance.wait_until); the slot is given up when the import returns (the guest
        # then runs in its worker, taking nothing here).
        try:
            if fn is None:
                raise wasmtime.WasmtimeError(f"{call.name}: no such import on this host")
            reply = wire.Reply(self.id, fn(None, *call.args))
        except wasmtime.WasmtimeError as e:
            reply = wire.Reply(self.id, trap=str(e))
        except Terminated as e:  # (a warm instance stopped while parked at its first call)
            reply = wire.Reply(self.id, trap=f"{call.name}: instance terminated: {e}")
        except Exception as e:  # (the imports turn their errors into traps; this is a host bug)
            log.exception("host import %s failed", call.name)
            reply = wire.Reply(self.id, trap=f"{call.name}: internal host error: {type(e).__name__}: {e}")
        finally:
            self.env.gate.leave()
        if not self._worker_unparked:  # a launched warm one: before the answer to the call it parked at
            self._unpark_worker()
        if not call.oneway:
            return reply
        if reply.trap is not None:
            self.deferred_trap = reply.trap
        return None

    def _finish(self, msg: _Finish) -> wire.Reply | None:
        """Answer a call begun on the reader whose finish waits (on this thread, in the run gate as
        `_serve`; a one-way call's trap is kept for the guest's next call)."""
        try:
            value, trap = msg.begun.finish(True), None
        except Exception as e:
            value, trap = None, str(as_trap(self, msg.call.name, e))
        finally:
            self.env.gate.leave()
        return self._answer_now(msg.call, value, trap, send=False)

    def serve_now(self, call: wire.Call) -> bool:
        """The worker's reader thread serves a call itself when it can do so without waiting: this
        instance's thread has nothing to serve, and the call is a decode step of a guest stepping
        with lookahead (`_step_now`) or an import that can be begun without waiting (its `begin`:
        the host-side generation loops, the release of pages). A job such a call queues is queued
        from here and its answer made and sent from the worker's answering thread when the job is
        done, so the call costs no wake-up of this instance's thread (two per call otherwise, each
        a GIL hand-over among the host's threads). Returns False when the call must go to the thread."""
        if (self.queued != self.served or self.deferred_trap is not None or self.stop_reason is not None
                or not self._worker_unparked):
            return False
        if call.name == _STEP:
            return self._step_now(call)
        begin = getattr(self.pool.imports.get(call.name), "begin", None)
        if begin is None:
            return False
        try:
            begun = begin(self, *call.args)
        except Exception as e:
            self._answer_now(call, trap=str(as_trap(self, call.name, e)))
            return True
        if begun is None:  # (it would wait: the thread serves it)
            return False
        fut = begun.fut
        if fut is None:  # answered as it began
            self._done_now(call, begun)
            return True
        fast = _Fast(call.name, fut, begun.abort)
        if not self._begin_fast(fast):
            return True
        if not fut.done():  # it waits, as in `wait_for`: no longer starting (env.starts), nor expected by the scheduler
            self._blocking()

        def answer() -> wire.Reply | None:
            if not self._end_fast(fast):
                return None
            return self._done_now(call, begun, send=False)

        self._answer_when_done(fut, answer)
        return True

    def _done_now(self, call: wire.Call, begun: Begun, send: bool = True) -> wire.Reply | None:
        """The answer of a begun call whose job is done; made on this instance's thread where that waits
        (None then: the thread sends it). `send`: send it from here (else: return it)."""
        try:
            value = begun.finish(False)
        except Exception as e:
            return self._answer_now(call, trap=str(as_trap(self, call.name, e)), send=send)
        if value is WOULD_WAIT:
            self.queued += 1  # (the guest waits for this answer: no other call of it is counted meanwhile)
            self.to_thread(_Finish(call, begun))
            return None
        return self._answer_now(call, value, send=send)

    def _answer_now(self, call: wire.Call, value: object = None, trap: str | None = None,
                    send: bool = True) -> wire.Reply | None:
        """A call's answer made off this instance's thread: a one-way call's trap is kept for the guest's next call."""
        if call.oneway:
            if trap is not None:
                self.deferred_trap = trap
            return None
        reply = wire.Reply(self.id, value, trap=trap)
        if send:
            self._reply(reply)
            return None
        return reply

    def _begin_fast(self, fast: _Fast) -> bool:
        """Note a job begun on the reader (`terminate` answers it from now on); False if the instance
        was terminated meanwhile (then the job is ended and the trap sent here)."""
        with self._fast_lock:
            stopped = self.stop_reason is not None  # (terminated meanwhile: `terminate` saw no job)
            if not stopped:
                self._fast = fast
        if stopped:
            fast.abort()
            self._reply(wire.Reply(self.id, trap=f"{fast.name}: instance terminated: {self.stop_reason}"))
        return not stopped

    def _end_fast(self, fast: _Fast) -> bool:
        """Claim the answer of a job begun on the reader; False if `terminate` answered it."""
        with self._fast_lock:
            if self._fast is not fast:
                return False
            self._fast = None
        return True

    def _answer_when_done(self, fut: ForwardFuture, answer: Callable[[], wire.Reply | None]) -> None:
        worker = self.worker
        assert worker is not None
        if fut.done():  # (done already: answered from here, without a hand-off)
            reply = answer()
            if reply is not None:
                self._reply(reply)
            return
        fut.add_done_callback(lambda _f: worker.answer(answer))

    def _step_now(self, call: wire.Call) -> bool:
        """A decode step served on the reader: the guest steps with lookahead (its `Stepper` is made at
        its first step, on its thread), and its pages are not being suspended. A prediction that ran
        before the guest claimed it is answered from here, and its successor queued from here, without
        a hand-off, before the batch after it starts."""
        stepper = self.stepper
        if call.oneway or not isinstance(stepper, Stepper):
            return False
        gate = stepper.passes.gate_now(self)
        if gate is None:  # (suspended, or being suspended: the thread waits for its resume)
            return False
        try:
            try:
                fut, trusted = stepper.begin(*call.args)
            finally:
                gate.__exit__(None, None, None)
            pages, last_len, _token, position, _sampler = call.args
        except Exception as e:
            self._reply(wire.Reply(self.id, trap=str(as_trap(self, _STEP, e))))
            return True

        def abort() -> None:
            fut.follow = None

        fast = _Fast(_STEP, fut, abort)
        if not self._begin_fast(fast):
            return True

        def answer() -> wire.Reply | None:
            if not self._end_fast(fast):
                return None
            try:
                out = fut.wait()[0].token
                if out is None:
                    raise RuntimeError("the step drew no token")
                reply = wire.Reply(self.id, stepper.end(fut, trusted, out, pages, last_len, position, wait=False))
            except Exception as e:
                reply = wire.Reply(self.id, trap=str(as_trap(self, _STEP, e)))
            return reply

        self._answer_when_done(fut, answer)
        return True

    def _reply(self, reply: wire.Reply) -> None:
        assert self.worker is not None
        try:
            self.worker.write([encode_reply(reply)])
        except (OSError, ValueError):  # the worker is gone: its end comes as WorkerLost
            pass
