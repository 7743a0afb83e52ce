"""An instance worker: a process of its own that runs guests for the host (`HostConfig.workers`).

The worker has its own interpreter, wasmtime engine and pool of instance slots; it makes each
guest's store, instantiates its component (loaded from the host's disk cache: compiled once, by
the host), runs it, converts the values of its host calls, and frees the store when it ends: the
CPU-heavy part of an instance's life. A WIT import that touches the
host's state is a stub that sends the call to the host (`wire.Call`) and waits for the host's
answer (`wire.Reply`): the host runs the import itself, on that instance's thread there, against
the scheduler, the pages and the shared state, which stay in its process. What is answered here
(`LOCAL`, with the same import functions as the host's): the model's constants, the tokenizer's
imports (the host's tokenizer, pickled once into the spec; forwarded when it does not pickle), and
the instance's own identity, arguments and return value; WASI (stdout / stderr kept for the end
message, clock waits), the memory limits and the epoch checks (a `wire.Stop` from the host traps a
computing guest).

Each guest runs as an `Instance` (host/wasm/instance.py) with the host's id, so its limits, its
trap classification and `current()` work as in the host's process.
"""

from __future__ import annotations

import functools
import logging
import pickle
import queue
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import wasmtime
from wasmtime.component import Linker, ResourceType

from gpu_backend.types import BackendInfo
from host.api import model as model_api
from host.api import runtime as runtime_api
from host.api import wasi
from host.api.fastcall import add_func
from host.batching.gate import RunGate
from host.events import InstanceEvent
from host.replay.recorder import Recorder
from host.wasm import priority
from host.wasm.engine import WasmEngine
from host.wasm.instance import Instance, InstanceEnv, current
from host.wasm.limits import InstanceLimits
from host.wasm.pooling import PoolingConfig
from host.workers import wire
from host.workers.frames import Frames

__all__ = ["LOCAL", "WorkerSpec", "main"]

log = logging.getLogger(__name__)

# Imports a worker answers itself once its instance is launched (a warm one's calls before that go to
# the host, where it parks): they read only the instance's own arguments and the model's tokenizer.
LOCAL_RUNTIME = frozenset({"runtime.version", "runtime.instance-id", "runtime.arguments", "runtime.set-return"})
LOCAL_MODEL = frozenset({"model.load-model", "model.apply-chat-template", "model.apply-chat-template-json",
                         "model.encode", "model.encode-prompt", "model.decode"})
LOCAL = LOCAL_RUNTIME | LOCAL_MODEL

# Imports that return nothing and whose only failure is a trap: sent without waiting for the host
# (`wire.Call.oneway`), as are the resources' destructors. The host serves an instance's calls in
# order, so the next call sees their effects; one that fails traps the guest at its next call to the
# host (or ends it with that trap). A launched instance has at most `ONEWAY_MAX` of them unanswered:
# the next waits for its reply, which follows every earlier call's service.
ONEWAY = frozenset({"runtime.log", "runtime.set-priority", "kv.release", "messaging.send", "messaging.publish",
                    "messaging.subscribe", "messaging.unsubscribe", "store.set", "store.delete"})
ONEWAY_MAX = 32
_FREES_WAIT_S = 1.0  # the longest a warm guest waits for the reaper (`_Worker._await_frees`)


def _deliver(replies: queue.SimpleQueue[wire.Reply], reply: wire.Reply) -> bool:
    """The run gate's wake-up of a guest waiting for `reply` (it waits for every reply it is sent)."""
    replies.put(reply)
    return True


class _Channel:
    """One instance's side of the connection: its replies, and its one-way calls since the last."""

    __slots__ = ("replies", "unanswered")

    def __init__(self) -> None:
        self.replies: queue.SimpleQueue[wire.Reply] = queue.SimpleQueue()
        self.unanswered = 0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to serve the host: where the compiled components are, the engine's
    settings (the same as the host's: a serialized component loads only on the same config), the
    guests' limits, and the imports to stub (version -> interface -> names; resources by interface:
    (name, type id))."""

    index: int
    cache_dir: Path
    epoch_tick_ms: float
    limits: InstanceLimits
    pool_slots: int | None  # None: wasmtime's on-demand allocator
    imports: dict[str, dict[str, list[str]]]
    resources: dict[str, list[tuple[str, int]]]
    package: str
    constants: dict[str, Any] = field(default_factory=dict)  # "interface.name" -> the answer (no call)
    wit_version: str = ""  # what runtime.version answers
    info: BackendInfo | None = None  # the model's facts (the tokenizer's imports check ids against it)
    tokenizer: bytes | None = None  # the host's tokenizer, pickled (None: its imports go to the host)
    warm_in_background: bool = False  # warm guests run at the lowest CPU priority until launched (`HostConfig.warm_yield`)


class _Worker:
    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        self.conn, self.spec = conn, spec
        self._send_lock = threading.Lock()
        pooling = PoolingConfig(spec.pool_slots, spec.limits) if spec.pool_slots else None
        # Ended guests' stores are freed by a reaper (host/wasm/reaper.py): at the lowest CPU priority
        # where threads can be lowered, else while no guest runs here (within its delay): a burst's
        # ends and next starts are not made to wait for the frees (a slot's reset is ~1 ms of CPU).
        self.engine = WasmEngine(spec.cache_dir, spec.epoch_tick_ms, pooling, busy=lambda: bool(self.instances),
                                 background=priority.available())
        self.local = self._local_imports()
        self.linker = self._linker()
        # the host enforces the wall budget (it stops the guest); here only the memory limits apply
        limits = InstanceLimits(**{**vars(spec.limits), "wall_budget_s": None})
        # A warm guest starts at the lowest CPU priority, as in the host, until its Unpark: refilling
        # the pool while a burst runs must not take the CPU from the burst's guests (nor, on a
        # machine with few cores, from the host's scheduler).
        self.env = InstanceEnv(engine=self.engine, linker=self.linker, gate=RunGate(True), limits=limits,
                               on_block=lambda _iid: None, on_end=self._ended,
                               warm_in_background=spec.warm_in_background and priority.available(),
                               before_warm_store=self._await_frees)
        self.engine.on_tick.append(self.env.gate.poll)  # queued wake-ups go out even if holders stall
        self.instances: dict[str, Instance] = {}
        self.channels: dict[str, _Channel] = {}
        self._unparked: dict[str, tuple[str, ...]] = {}  # warm instances launched before their Launch came: their args
        self._lock = threading.Lock()

    def _await_frees(self) -> None:
        """A warm guest makes its store once the stores of the guests that ended here are freed (for
        at most `_FREES_WAIT_S`), as the host's warm pool waits for its own reaper (WasmEngine.reaping):
        the pooling allocator then hands it a slot just reset, its pages resident. Refilled while
        the reaper (at the lowest priority) still held a burst's stores, warm guests took other
        slots, and every reset faulted its pages in again: half a worker's CPU per instance went
        to the kernel (bench/host_scale_b2b_workers.md)."""
        if self.engine.reaper is not None:
            self.engine.reaper.wait_drained(_FREES_WAIT_S)

    def send(self, msg: Any, store: Any = None) -> None:
        data = wire.dumps(msg, store)
        with self._send_lock:
            self.conn.send_bytes(data)

    def _local_imports(self) -> dict[str, Any]:
        """The imports answered here (`LOCAL`), by "interface.name": the host's own functions."""
        spec = self.spec
        table = {f"runtime.{n}": fn for n, fn in runtime_api.imports(spec.wit_version, []).items()}
        local = {n: table[n] for n in LOCAL_RUNTIME}
        if spec.tokenizer is not None and spec.info is not None:
            try:
                tok = pickle.loads(spec.tokenizer)
            except Exception as e:  # (a class this process cannot import): the host answers them
                log.warning("the tokenizer does not load here (%s: %s); its imports go to the host",
                            type(e).__name__, e)
            else:
                table = {f"model.{n}": fn for n, fn in model_api.imports(spec.info, tok).items()}
                local.update({n: table[n] for n in LOCAL_MODEL})
        return local

    def _linker(self) -> Linker:
        linker = Linker(self.engine.engine)
        linker.add_wasip2()
        wasi.add_clock_waits(linker, self.engine.engine)
        with linker.root() as root:
            for version, tables in self.spec.imports.items():
                for iface, names in tables.items():
                    with root.add_instance(f"{self.spec.package}/{iface}@{version}") as li:
                        for res, ty in self.spec.resources.get(iface, []):
                            li.add_resource(res, ResourceType.host(ty), self._dtor(f"$drop.{iface}.{res}"))
                        for name in names:
                            add_func(li, name, self._stub(f"{iface}.{name}", f"{iface}.{name}" in ONEWAY),
                                     label=f"{iface}.{name}")
        return linker

    def _stub(self, name: str, oneway: bool = False) -> Any:
        if name in self.spec.constants:  # the model's constants: answered here
            value = self.spec.constants[name]
            return lambda store: value
        fn = self.local.get(name)
        if fn is not None:
            def local(store: Any, *args: Any) -> Any:
                inst = current(park=False)
                if inst.parked:  # a warm instance not launched yet: it parks at the host
                    return self._call(inst, name, args, store)
                return fn(store, *args)

            return local

        def call(store: Any, *args: Any) -> Any:
            inst = current(park=False)
            # (a recorded guest waits for every answer, as in-process: it sees a failure at that call)
            return self._call(inst, name, args, store, oneway and inst.recorder is None)

        return call

    def _dtor(self, name: str) -> Any:
        def drop(store: Any, rep: int) -> None:
            try:
                inst = current(park=False)
            except wasmtime.WasmtimeError:  # dropped with its store: the host releases it at the end
                return
            self._call(inst, name, (rep,), store, oneway=True)

        return drop

    def _call(self, inst: Instance, name: str, args: tuple[Any, ...], store: Any, oneway: bool = False) -> Any:
        """Send the call to the host and wait for its reply (the host answers every call, with a
        value or the trap it raises; a stopped guest traps at its next epoch check after it); a
        `oneway` call of a launched instance is not waited for (`ONEWAY`)."""
        channel = self.channels[inst.id]
        oneway = oneway and not inst.parked and channel.unanswered < ONEWAY_MAX
        # (a two-way call's reply comes after every earlier call is served)
        channel.unanswered = channel.unanswered + 1 if oneway else 0
        try:
            self.send(wire.Call(inst.id, name, args, oneway), store)
        except wire.WireError as e:  # (an argument of a type that cannot cross)
            inst.trap_reason = f"{name}: {e}"
            raise wasmtime.WasmtimeError(inst.trap_reason) from None
        if oneway:
            return None
        gate = self.env.gate
        gate.leave()  # (while it waits, another guest runs)
        reply = channel.replies.get()
        gate.enter()
        if reply.trap is not None:
            inst.trap_reason = reply.trap
            raise wasmtime.WasmtimeError(reply.trap)
        return reply.value

    def launch(self, msg: wire.Launch) -> None:
        with self._lock:
            args = self._unparked.pop(msg.iid, None) if msg.warm else None
        warm = msg.warm and args is None
        recorder = Recorder(msg.record) if msg.record > 0 else None  # its calls, all made here (host/replay/)
        inst = Instance(self.env, msg.program, list(msg.args if args is None else args),
                        self._listener(msg.iid, recorder), warm=warm)
        inst.id = msg.iid  # the host's: calls and the end name it
        inst.label = f"instance {msg.iid[:8]}"
        if recorder is not None:
            inst.recorder = recorder
            recorder.tap()
        with self._lock:
            self.instances[msg.iid] = inst
            self.channels[msg.iid] = _Channel()
        inst.start()

    def _listener(self, iid: str, recorder: Recorder | None = None) -> Any:
        def on_event(ev: InstanceEvent) -> None:
            if ev.terminal:
                if recorder is not None:  # (before its end: the host finishes the recording then)
                    recorder.untap()
                    for calls, count in recorder.pieces():
                        self.send(wire.Recorded(iid, calls, count, recorder.truncated))
                self.send(wire.Ended(iid, ev.event, ev.message))
            elif ev.event == "log":  # its stdout / stderr (runtime.log is served by the host)
                self.send(wire.Output(iid, ev.stream, ev.message))

        return on_event

    def _ended(self, inst: Instance) -> None:
        with self._lock:
            self.instances.pop(inst.id, None)
            self.channels.pop(inst.id, None)

    def serve(self) -> None:
        frames = Frames(self.conn.fileno())  # (a step's answers come in one read)
        while True:
            try:
                batch = frames.read()
            except (EOFError, OSError):  # the host is gone
                return
            for data in batch:
                if not self._handle(wire.loads(data, wire.FROM_HOST)):
                    return

    def _handle(self, msg: Any) -> bool:
        """Act on one message from the host; False at its `Quit`."""
        if isinstance(msg, wire.Reply):
            with self._lock:
                channel = self.channels.get(msg.iid)
            if channel is not None:  # its guest wakes in its turn (a step's answers arrive together)
                self.env.gate.wake(functools.partial(_deliver, channel.replies, msg))
        elif isinstance(msg, wire.Launch):
            self.launch(msg)
        elif isinstance(msg, wire.Unpark):
            with self._lock:
                inst = self.instances.get(msg.iid)
                if inst is None:  # (it overtook its Launch)
                    self._unparked[msg.iid] = msg.args
            if inst is not None:
                with inst.cond:
                    inst.args = list(msg.args)
                    inst.parked = False
                    inst.to_foreground()
        elif isinstance(msg, wire.Stop):
            with self._lock:
                inst = self.instances.get(msg.iid)
            if inst is not None:
                inst.terminate(msg.reason)
        elif isinstance(msg, wire.Quit):
            return False
        return True


def main(fd: int) -> None:
    """The worker process's entry point (`python -m host.workers.worker FD`, FD its end of the
    connection): read its `WorkerSpec`, then serve the host until it quits or goes away."""
    conn = Connection(fd)
    spec = pickle.loads(conn.recv_bytes())  # (from the host that started this process)
    logging.basicConfig(level=logging.WARNING, format=f"pie worker {spec.index}: %(levelname)s %(message)s")
    worker = _Worker(conn, spec)
    worker.send(wire.Ready(spec.index))
    try:
        worker.serve()
    finally:
        for inst in list(worker.instances.values()):
            inst.terminate("the host shut its workers down")
        worker.engine.stop()


if __name__ == "__main__":
    main(int(sys.argv[1]))
