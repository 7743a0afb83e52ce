"""Instance workers on the host's side: the worker processes, and `RemoteInstance`, an instance whose
guest runs in one of them (`HostConfig.workers` > 0).

What runs where. A worker (host/workers/worker.py) makes the guest's store, runs its wasm and
converts the values of its host calls: the start, the guest's own code and the end of every
instance, which on one interpreter cost ~2 ms of GIL-held work each. The host keeps everything
the instances share and the backend sees: the scheduler (one batch per step, from every worker's
instances), the KV pages and prefix cache, the suspender, pub/sub, the key-value store, the
tenants' bounds, the events. Each import a guest calls is sent over (`wire.Call`) and run by the
instance's `RemoteInstance` thread here, the same import function as an in-process instance's,
with `current()` that instance; its result goes back (`wire.Reply`). A host-side generation loop
(`forward.generate`) runs next to the scheduler as before: only the call that starts it and its
result cross. Per call: one message each way.

An instance lives on the least loaded worker (`place`). A worker that dies ends its instances with
an `exception` event naming the cause, after which their pages are released as for any end; the
pool starts a new worker in its place.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import Pipe
from typing import Any

import wasmtime

from host.api.guest import as_trap
from host.api.lookahead import Stepper
from host.batching.future import ForwardFuture
from host.events import TERMINAL_EVENTS, InstanceEvent
from host.wasm import instance as instance_module
from host.wasm.instance import Instance, InstanceEnv, Terminated
from host.workers import wire
from host.workers.worker import WorkerSpec

__all__ = ["RemoteInstance", "WorkerPool"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # a worker not ready by then fails the host's start
_STEP = "forward.decode-step"  # served on the reader thread when it can be (`RemoteInstance.serve_now`)


@dataclass(frozen=True)
class _WorkerLost:
    """The instance's worker died: its guest is gone."""

    reason: str


class _Worker:
    """One worker process and the host's end of its connection. The process is started as
    `python -m host.workers.worker FD` (not by multiprocessing's spawn, which imports the host's
    `__main__` again in the child: a user's script without a main guard would run twice), its end
    of a socket pair inherited as FD; the first message is its `WorkerSpec`."""

    def __init__(self, index: int, spec: WorkerSpec, on_message: Callable[[_Worker, Any], None],
                 on_exit: Callable[[_Worker], None]) -> None:
        self.index = index
        self.conn, child = Pipe(duplex=True)
        try:
            self.process = subprocess.Popen([sys.executable, "-m", "host.workers.worker", str(child.fileno())],
                                            pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        self._send_lock = threading.Lock()
        self.instances: set[str] = set()  # ids of the instances it runs
        self.launched = 0  # instances placed on it, ever
        self.calls = 0  # host calls its guests made, ever (counted by its reader thread)
        self.steps_on_reader = 0  # of those, decode steps its reader thread served (`RemoteInstance.serve_now`)
        self.ready = threading.Event()  # it has sent `wire.Ready`
        self._on_message, self._on_exit = on_message, on_exit
        self.conn.send_bytes(pickle.dumps(spec))  # (its settings, from us: the only pickle that crosses)
        self._reader = threading.Thread(target=self._read, name=f"pie-worker-{index}-reader", daemon=True)
        self._reader.start()
        # Answers made off the instances' threads (decode steps served on the reader): one thread sends
        # a step's answers, so the scheduler thread that finished the step only queues them.
        self._answers: queue.SimpleQueue[Callable[[], wire.Reply | None] | None] = queue.SimpleQueue()
        self._answerer = threading.Thread(target=self._answer, name=f"pie-worker-{index}-answers", daemon=True)
        self._answerer.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def send(self, msg: Any) -> None:
        self.write([wire.dumps(msg)])

    def write(self, datas: list[bytes]) -> None:
        """Send encoded messages, in one write."""
        with self._send_lock:
            wire.send_frames(self.conn.fileno(), datas)

    def answer(self, fn: Callable[[], wire.Reply | None]) -> None:
        """Make an answer with `fn` on this worker's answering thread, and send it."""
        self._answers.put(fn)

    def _answer(self) -> None:
        """The answering thread: the answers made at once (a step's) go in one write."""
        answers, end = self._answers, False
        while not end:
            fns = [answers.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    fns.append(answers.get_nowait())
            datas = []
            for fn in fns:
                if fn is None:  # (the end: after the answers before it)
                    end = True
                    continue
                try:
                    reply = fn()
                    if reply is not None:
                        datas.append(_encode(reply))
                except Exception:  # (a host bug: that instance's guest waits until it is stopped)
                    log.exception("answering a call of instance worker %d failed", self.index)
            if datas:
                try:
                    self.write(datas)
                except (OSError, ValueError):  # the worker is gone: its instances end as _WorkerLost
                    pass

    def _read(self) -> None:
        frames = wire.Frames(self.conn.fileno())
        while True:
            try:
                batch = frames.read()
            except (EOFError, OSError):
                break
            except wire.WireError as e:
                log.error("instance worker %d sent a malformed frame (%s): stopping it", self.index, e)
                self.process.kill()
                break
            if not self._dispatch(batch):
                break
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
        self._on_exit(self)
        self._answers.put(None)

    def _dispatch(self, frames: list[bytes]) -> bool:
        """Hand the messages on; False (the worker is stopped) at one that is not ours."""
        for data in frames:
            try:
                msg = wire.loads(data)
            except wire.WireError as e:  # not one of our messages: the worker is not ours any more
                log.error("instance worker %d sent a malformed message (%s): stopping it", self.index, e)
                self.process.kill()
                return False
            if isinstance(msg, wire.Ready):
                self.ready.set()
                continue
            if isinstance(msg, wire.Call):
                self.calls += 1
            self._on_message(self, msg)
        return True


class WorkerPool:
    """`n` worker processes running guests for one host; `imports` by "interface.name" (and the
    resources' destructors by "$drop.interface.resource"), as an in-process instance's linker has them."""

    def __init__(self, n: int, spec: WorkerSpec, imports: dict[str, Callable[..., Any]]) -> None:
        if n < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {n}")
        self._spec = spec
        self.imports = imports
        self._lock = threading.Lock()
        self._instances: dict[str, RemoteInstance] = {}
        self._closed = False
        self.restarts = 0  # workers started again after one died
        self.workers = [self._start(i) for i in range(n)]
        for w in self.workers:  # (a worker imports the host and builds its linker: ~1-2 s, in parallel)
            if not w.ready.wait(_START_TIMEOUT_S):
                self.close()
                raise RuntimeError(f"instance worker {w.index} did not start within {_START_TIMEOUT_S:g} s "
                                   f"(exit code {w.process.poll()}; its stderr says why)")

    def _start(self, index: int) -> _Worker:
        return _Worker(index, WorkerSpec(**{**vars(self._spec), "index": index}), self._message, self._exited)

    def place(self, inst: RemoteInstance) -> _Worker:
        """Put `inst` on the worker running the fewest instances and launch its guest there."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the host's workers are shut down")
            worker = min(self.workers, key=lambda w: len(w.instances))
            worker.instances.add(inst.id)
            worker.launched += 1
            self._instances[inst.id] = inst
            inst.worker = worker  # (before its Launch: a launch of a warm instance sends its Unpark there)
        with inst.cond:
            warm = inst.parked
            if not warm:  # (launched before it was placed: its Launch says so)
                inst._worker_unparked = True
        worker.send(wire.Launch(inst.id, inst.program, warm, tuple(inst.args)))
        return worker

    def release(self, inst: RemoteInstance) -> None:
        with self._lock:
            self._instances.pop(inst.id, None)
            if inst.worker is not None:
                inst.worker.instances.discard(inst.id)

    def _message(self, worker: _Worker, msg: Any) -> None:
        with self._lock:
            inst = self._instances.get(msg.iid)
        if inst is None:
            return
        if inst.worker is not worker:  # (only a worker not ours any more names another's instance)
            log.error("instance worker %d sent a message for an instance it does not run: stopping it", worker.index)
            worker.process.kill()
            return
        if isinstance(msg, wire.Call):
            if inst.serve_now(msg):
                worker.steps_on_reader += 1
                return
            inst.queued += 1
        inst.inbound.put(msg)

    def _exited(self, worker: _Worker) -> None:
        """A worker's connection closed: its instances end; a new worker takes its place."""
        code = worker.process.returncode
        with self._lock:
            lost = [self._instances[i] for i in worker.instances if i in self._instances]
            # (one that never started is not started again: it would fail the same way, forever)
            restart = not self._closed and worker.ready.is_set() and self.workers[worker.index] is worker
        reason = f"the instance's worker process died (exit code {code})"
        for inst in lost:
            inst.failed_in_host = True
            inst.inbound.put(_WorkerLost(reason))
            inst.terminate(reason, "exception")  # (its thread may be blocked in an import here)
        if restart:
            log.error("instance worker %d died (exit code %s): %d instance(s) ended; starting it again",
                      worker.index, code, len(lost))
            with self._lock:
                self.restarts += 1
                self.workers[worker.index] = self._start(worker.index)

    def stats(self) -> list[dict[str, Any]]:
        """Per worker: its pid, the instances it runs now, those placed on it ever, the host calls
        its guests made (and of those the decode steps served on its reader thread) and its
        process's CPU seconds (None where /proc cannot tell)."""
        with self._lock:
            workers = list(self.workers)
        return [{"worker": w.index, "pid": w.pid, "instances": len(w.instances), "launched": w.launched,
                 "calls": w.calls, "steps_on_reader": w.steps_on_reader, "cpu_s": _cpu_seconds(w.pid)}
                for w in workers]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers = list(self.workers)
        for w in workers:
            try:
                w.send(wire.Quit())
            except (OSError, ValueError):
                pass
        for w in workers:
            try:
                w.process.wait(5)
            except subprocess.TimeoutExpired:
                w.process.kill()
                w.process.wait(5)
            w.conn.close()


def _encode(reply: wire.Reply) -> bytes:
    """`reply` as bytes; a result that cannot cross (a host bug) becomes the guest's trap."""
    try:
        return wire.dumps(reply)
    except wire.WireError as e:
        log.error("the result of a host call of instance %s cannot cross to its worker: %s", reply.iid[:8], e)
        return wire.dumps(wire.Reply(reply.iid, trap=f"internal host error: {e}"))


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux's /proc; None elsewhere or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


class RemoteInstance(Instance):
    """An instance whose guest runs in a worker process (host/workers/worker.py): its thread here
    serves the guest's host calls, one at a time, and ends with the guest. Everything else (its
    pages, forwards, inbox, subscriptions, events, terminate, the wall budget, a warm instance's
    parking at its first call) is an `Instance`'s."""

    def __init__(self, env: InstanceEnv, program: str, args: list[str],
                 on_event: Callable[[InstanceEvent], None], warm: bool = False,
                 pool: WorkerPool | None = None) -> None:
        super().__init__(env, program, args, on_event, warm)
        if pool is None:
            raise ValueError("a RemoteInstance needs a WorkerPool")
        self.pool = pool
        self.worker: _Worker | None = None
        self.inbound: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.deferred_trap: str | None = None  # a one-way call failed: the guest traps at its next call
        self._worker_unparked = not warm  # its worker knows it was launched (guarded by cond)
        # Calls put in `inbound` (counted by the worker's reader thread) and of those served by this
        # instance's thread (counted by it): equal when it has none to serve.
        self.queued = 0
        self.served = 0
        self._fast_lock = threading.Lock()
        self._fast: ForwardFuture | None = None  # the job of a decode step served on the reader, not answered

    def terminate(self, reason: str, event: str = "aborted") -> None:
        first = self.stop_reason is None and not self.finished.is_set()
        super().terminate(reason, event)
        with self._fast_lock:  # (after stop_reason is set: `serve_now` answers a step it starts after this)
            fut, self._fast = self._fast, None
        if fut is not None:  # a decode step served on the reader: its answer is the trap, now
            fut.follow = None
            self._reply(wire.Reply(self.id, trap=f"{_STEP}: instance terminated: {self.stop_reason}"))
        worker = self.worker
        if first and worker is not None:  # a guest computing traps at its worker's next epoch check
            try:
                worker.send(wire.Stop(self.id, reason))
            except (OSError, ValueError):  # the worker is gone: its end comes as _WorkerLost
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
        instance_module._current.instance = self
        self.check_alive()  # (terminated before it started: ends at once, as in-process)
        self.pool.place(self)
        if self.stop_reason is not None and self.worker is not None:  # terminated while placed
            try:  # (its own Stop may have found no worker yet)
                self.worker.send(wire.Stop(self.id, self.stop_reason))
            except (OSError, ValueError):  # the worker is gone: its end comes as _WorkerLost
                pass
        self.state = "warm" if self.parked else "running"
        while True:
            msg = self.inbound.get()
            if isinstance(msg, wire.Call):
                reply = self._serve(msg)
                self.served += 1  # (before the answer: the guest's next call may be served on the reader)
                if reply is not None:
                    self._reply(reply)
            elif isinstance(msg, wire.Ended):
                event, message = msg.event, msg.message
                if event not in TERMINAL_EVENTS:  # (the worker classifies as Instance does)
                    event, message = "exception", f"the worker ended the instance with {event!r}: {message}"
                break
            elif isinstance(msg, _WorkerLost):
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

    def serve_now(self, call: wire.Call) -> bool:
        """The worker's reader thread serves a decode step itself when it can do so without waiting:
        the instance's thread has nothing to serve, the guest steps with lookahead (its `Stepper`
        is made at its first step, on its thread), and its pages are not being suspended. The step's
        job is queued from here and its answer sent from the worker's answering thread when the job
        is done, so a step costs no wake-up of this instance's thread (two per step otherwise, each a
        GIL hand-over among the host's threads). Returns False when the call must go to the thread."""
        stepper = self.stepper
        if (call.name != _STEP or call.oneway or self.queued != self.served or self.deferred_trap is not None
                or self.stop_reason is not None or not self._worker_unparked or not isinstance(stepper, Stepper)):
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
        with self._fast_lock:
            stopped = self.stop_reason is not None  # (terminated meanwhile: `terminate` saw no job)
            if not stopped:
                self._fast = fut
        if stopped:
            fut.follow = None
            self._reply(wire.Reply(self.id, trap=f"{_STEP}: instance terminated: {self.stop_reason}"))
            return True
        worker = self.worker
        assert worker is not None

        def answer() -> wire.Reply | None:
            with self._fast_lock:
                if self._fast is not fut:  # answered by `terminate`
                    return None
                self._fast = None
            try:
                out = fut.wait()[0].token
                if out is None:
                    raise RuntimeError("the step drew no token")
                reply = wire.Reply(self.id, stepper.end(fut, trusted, out, pages, last_len, position, wait=False))
            except Exception as e:
                reply = wire.Reply(self.id, trap=str(as_trap(self, _STEP, e)))
            return reply

        fut.add_done_callback(lambda _f: worker.answer(answer))
        return True

    def _reply(self, reply: wire.Reply) -> None:
        assert self.worker is not None
        try:
            self.worker.write([_encode(reply)])
        except (OSError, ValueError):  # the worker is gone: its end comes as _WorkerLost
            pass
