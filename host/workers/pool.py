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
result cross. Per call: one message each way. A stepping guest's `decode-step`, a generation loop's
start and `kv.release` are served by the worker's reader thread here instead when that needs no
wait (`RemoteInstance.serve_now`), and answered, with the other answers of the same step in one
write, by the worker's answering thread when the job is done: no wake-up of the instance's thread.

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
from multiprocessing import Pipe
from typing import Any

from host.workers import wire
from host.workers.frames import Frames, send_frames
from host.workers.remote import RemoteInstance, WorkerLost, encode_reply
from host.workers.worker import WorkerSpec

__all__ = ["RemoteInstance", "WorkerPool"]

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 60.0  # a worker not ready by then fails the host's start


class _Worker:
    """One worker process and the host's end of its connection. The process is started as
    `python -m host.workers.worker FD` (not by multiprocessing's spawn, which imports the host's
    `__main__` again in the child: a user's script without a main guard would run twice), its end
    of a socket pair inherited as FD; the first message is its `WorkerSpec`."""

    def __init__(self, index: int, spec: WorkerSpec, on_message: Callable[[_Worker, Any], None],
                 on_exit: Callable[[_Worker], None]) -> None:
        self.index = index
        self._memory_bytes = spec.limits.memory_bytes
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
        self.calls_on_reader = 0  # of those, the calls its reader thread served (`RemoteInstance.serve_now`)
        self.steps_on_reader = 0  # of those, decode steps
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
            send_frames(self.conn.fileno(), datas)

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
                        datas.append(encode_reply(reply))
                except Exception:  # (a host bug: that instance's guest waits until it is stopped)
                    log.exception("answering a call of instance worker %d failed", self.index)
            if datas:
                try:
                    self.write(datas)
                except (OSError, ValueError):  # the worker is gone: its instances end as WorkerLost
                    pass

    def _read(self) -> None:
        # (what a guest sends is read from its memory: a frame twice its size is not a guest's)
        frames = Frames(self.conn.fileno(), max_frame=2 * self._memory_bytes + (1 << 20))
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
        record = inst.recorder.max_bytes if inst.recorder is not None else 0  # (its worker records its calls)
        worker.send(wire.Launch(inst.id, inst.program, warm, tuple(inst.args), record))
        return worker

    def release(self, inst: RemoteInstance) -> None:
        with self._lock:
            self._instances.pop(inst.id, None)
            if isinstance(inst.worker, _Worker):  # (the worker `place` put it on)
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
        if isinstance(msg, wire.Output):  # (on this thread: no wake-up of the instance's)
            if msg.stream in ("stdout", "stderr"):
                inst.log_line(msg.stream, msg.text)
            return
        if isinstance(msg, wire.Recorded):  # (before its Ended: complete when the instance ends)
            if inst.recorder is not None:
                inst.recorder.extend(msg.calls, msg.count, msg.truncated)
            return
        if isinstance(msg, wire.Call):
            if inst.serve_now(msg):
                worker.calls_on_reader += 1
                if msg.name == "forward.decode-step":
                    worker.steps_on_reader += 1
                return
            inst.queued += 1
        inst.to_thread(msg)

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
            inst.to_thread(WorkerLost(reason))
            inst.terminate(reason, "exception")  # (its thread may be blocked in an import here)
        if restart:
            log.error("instance worker %d died (exit code %s): %d instance(s) ended; starting it again",
                      worker.index, code, len(lost))
            with self._lock:
                self.restarts += 1
                self.workers[worker.index] = self._start(worker.index)

    def stats(self) -> list[dict[str, Any]]:
        """Per worker: its pid, the instances it runs now, those placed on it ever, the host calls
        its guests made (of those, the calls served on its reader thread, and the decode steps among them) and its
        process's CPU seconds (None where /proc cannot tell)."""
        with self._lock:
            workers = list(self.workers)
        return [{"worker": w.index, "pid": w.pid, "instances": len(w.instances), "launched": w.launched,
                 "calls": w.calls, "calls_on_reader": w.calls_on_reader, "steps_on_reader": w.steps_on_reader, "cpu_s": _cpu_seconds(w.pid)}
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


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (Linux's /proc; None elsewhere or once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None
