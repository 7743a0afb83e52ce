"""The `Host` facade: one backend, one wasm engine, many sandboxed instances.

    with Host(HostConfig()) as host:
        program = host.compile(open("app.wasm", "rb").read())
        iid = host.launch(program, ["--prompt", "hi"], on_event=print)
        host.wait(iid)

It composes the layers (see docs/architecture.md) and hands each part only what it needs:
instances get an `InstanceEnv`, the WIT imports get `ApiServices`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from gpu_backend.types import Backend
from host.api import ApiServices, build_linker
from host.api.embed import SlotLimits
from host.assembly import (
    http_service,
    instance_limits,
    instance_pool,
    make_replicas,
    start_engines,
    start_workers,
)
from host.batching.gate import RunGate
from host.batching.scheduler import Scheduler
from host.children import Children
from host.config import HostConfig
from host.events import InstanceEvent
from host.introspect import HostStats
from host.launch_queue import HostBusy, LaunchQueue
from host.levels import check_priority
from host.replay.kept import Recordings
from host.replay.recorder import Recorder
from host.state.kvstore import KeyValueStore
from host.state.pages import PageManager
from host.state.topics import Topics
from host.tuning import ProcessTuning, background_threads, collect_when_idle
from host.wasm import priority
from host.wasm.engine import WasmEngine
from host.wasm.inbox import InboxFull
from host.wasm.instance import Instance, InstanceEnv
from host.wasm.starter import Starter
from host.wasm.starts import Starts
from host.wasm.warm import WarmPool
from host.workers.pool import RemoteInstance, WorkerPool

__all__ = ["Host", "HostBusy", "InboxFull"]

log = logging.getLogger(__name__)

_ENDED_KEPT = 1024  # ended instances remembered for wait() and their logs
LOG_RETENTION_S = 600.0  # how long an ended instance's log stays readable (Host.logs)
_WARM_PROGRAMS = 4  # programs kept warm at once (the most recently launched)
_REAP_PENDING = 512  # finished instances whose stores may wait for an idle backend (host/wasm/reaper.py)


class Host(HostStats):
    """Runs inferlet instances against one backend (any object implementing `gpu_backend.types.Backend`;
    None loads `config.model`)."""

    def __init__(self, config: HostConfig | None = None, backend: Backend | None = None,
                 progress: bool = True, engines: list[Any] | None = None) -> None:
        self.config = config = config or HostConfig()
        # Engine processes (config.engine / tp / replicas; docs/deployment.md) are started here, or
        # passed in (`engines`: gpu_backend.engine.client.ProcessBackend, one per replica, e.g. from
        # `start_engines`), and the host stops them in shutdown; a `backend` passed in is the
        # caller's and runs in-process.
        self.engines: list[Any] = list(engines or [])
        if self.engines:
            if backend is not None:
                raise ValueError("pass either backend or engines, not both")
        elif backend is None and config.engine_kind == "process":
            self.engines = start_engines(config)
        # each instance lives on one replica, its WIT imports reach that replica's pages and
        # scheduler (host/replicas.py); `pages` / `scheduler`: the first's (the only one by default)
        self.backend, self.replicas = make_replicas(config, backend, self.engines, progress)
        backend = self.backend
        info = backend.info
        self.model_name: str = info.name
        self.total_pages: int = info.num_pages * len(self.replicas)
        schedulers = [r.scheduler for r in self.replicas]
        self.pages: PageManager = self.replicas[0].pages
        self.scheduler: Scheduler = schedulers[0]
        self._load = [0] * len(self.replicas)  # running instances per replica (placement)
        for r, eng in enumerate(self.engines):
            eng.on_death.append(lambda reason, r=r: self._engine_died(r, reason))
        limits = instance_limits(config)
        # pool slots: the running instances, the warm ones, the finished ones whose stores wait to be freed
        slots = config.max_instances + config.warm_instances * _WARM_PROGRAMS + config.warm_auto + _REAP_PENDING + 8
        pooling = instance_pool(config, slots, limits)
        # Busy: forwards queued or running, or launched instances alive. Warm refills and store
        # frees wait for an idle host (the reaper still frees each store within a second).
        busy = lambda: bool(self._instances) or any(s.busy() for s in schedulers)  # noqa: E731
        background = config.warm_yield and priority.available()
        threads = background_threads()  # warmers, and reaper threads
        self.starts = Starts()  # launched instances not at their first wait yet: background work waits for them
        self.wasm = WasmEngine(config.cache_dir, config.epoch_tick_ms, pooling, busy, _REAP_PENDING, background,
                               ramping=self.starts.active, reapers=threads)
        self.kvstore = KeyValueStore((config.data_dir or config.cache_dir) / "kvstore.sqlite3",
                                     config.max_kv_store_bytes)
        self.topics = Topics()
        self.gate = RunGate(config.run_gate, slots=config.run_slots)
        self.wasm.on_tick.append(self.gate.poll)  # queued wake-ups go out even if holders stall
        self.http = http_service(config)
        self.children = Children(self.launch, self.terminate, self.signal, config.child_limits)
        self.services = ApiServices(
            info=info, tokenizer=backend.tokenizer, replicas=self.replicas,
            kvstore=self.kvstore, topics=self.topics, step_lookahead=self.config.step_lookahead,
            http=self.http, children=self.children,
            slot_limits=SlotLimits(config.max_embedding_slots, config.max_embedding_bytes))
        self.linker = build_linker(self.wasm.engine, self.services)
        self._env = InstanceEnv(
            engine=self.wasm, linker=self.linker, gate=self.gate,
            limits=limits, on_block=self._forget, on_end=self._instance_ended, warm_in_background=background,
            starts=self.starts)
        self._instances: dict[str, Instance] = {}  # running and queued
        self.queue = LaunchQueue(config)  # launches past max_instances (host/launch_queue.py)
        self.wasm.on_tick.append(self._admit)  # queued launches past their timeout end
        self._ended: OrderedDict[str, Instance] = OrderedDict()
        self.recordings = Recordings(config.max_recording_bytes, self.model_name)  # host/replay/kept.py
        self._lock = threading.Lock()
        self._starter = Starter()  # cold launches' threads are started on its thread
        self._closed = False
        self.workers: WorkerPool | None = None  # instances run in worker processes (HostConfig.workers)
        if config.worker_count > 0:
            self.workers = start_workers(config, self.services, limits, slots if pooling is not None else None)
            self.wasm.on_tick.append(self._tick_remote)
        self.warm = WarmPool(lambda program: self._new_instance(program, [], _ignore, warm=True),
                             config.warm_instances, _WARM_PROGRAMS, auto=config.warm_auto,
                             busy=busy, reaping=self.wasm.reaping, background=background, ramping=self.starts.active,
                             # (with workers, each starts its own warm guests, and a warmer waits through one round
                             # trip at a time: with one for all, bursts back to back found the pools empty)
                             warmers=threads * max(1, config.worker_count),
                             on_full=collect_when_idle if config.tune_gc else None)
        self.tuning = ProcessTuning(config.tune_gc, config.switch_interval_ms, str(getattr(info, "device", "")))
        self.switch_interval_ms = self.tuning.switch_interval_ms  # what this host set (0: Python's own)

    def _new_instance(self, program: str, args: list[str], listener: Callable[[InstanceEvent], None],
                      warm: bool = False) -> Instance:
        """An instance, not started: its guest runs on its own thread here, or in a worker process."""
        if self.workers is not None:
            return RemoteInstance(self._env, program, args, listener, warm=warm, pool=self.workers)
        return Instance(self._env, program, args, listener, warm=warm)

    def _tick_remote(self) -> None:
        """Each epoch tick: the wall budgets of instances whose guests run in workers (a worker's
        guest computing past its budget is stopped from here)."""
        if self.config.wall_budget_s is None:
            return
        with self._lock:
            insts = list(self._instances.values())
        for inst in insts:
            if isinstance(inst, RemoteInstance):
                inst.on_epoch()

    # ---- programs ----
    def compile(self, wasm: bytes) -> str:
        """Compile (cached on disk) a component; returns its sha256. Raises CompileError."""
        return self.wasm.compile(wasm)

    def has_program(self, program_hash: str) -> bool:
        return self.wasm.has(program_hash)

    # ---- instances ----
    def launch(self, program_hash: str, args: list[str],
               on_event: Callable[[InstanceEvent], None] | None = None, tenant: str = "local",
               priority: int = 0, record: bool = False) -> str:
        """Start an instance of a compiled program; returns its id. KeyError for an unknown program.

        `tenant` is the client identity the instance acts for: it sees only that tenant's KV exports.
        `priority` (host/levels.py: from -1000 to 1000, lower runs sooner; TypeError / ValueError
        otherwise) orders the launch queue, full batches and the choice of whom to suspend.
        With `max_instances` running, the launch waits in the launch queue (its id is returned at once,
        its state is "queued" until it starts; `launch_queue_timeout_s` later it ends with
        out_of_resources); raises HostBusy when the queue is full too. A warm instance is used when
        one is ready; a cold one's thread is started by the starter's thread (host/wasm/starter.py),
        so this returns without waiting for it. `record`: record every host call it makes and what it
        got back (host/replay/), kept after it ends: `recording`. A recorded launch starts cold (a
        warm guest made its first calls before anyone asked to record them)."""
        if self._closed:
            raise RuntimeError("host is shut down")
        check_priority(priority)
        self.wasm.get(program_hash)  # KeyError with a clear message if unknown
        listener = on_event or _ignore
        recorder = self.recordings.recorder(program_hash, args, tenant) if record else None
        if recorder is not None:
            listener = self.recordings.listener(recorder, tenant, listener)
        with self._lock:
            if len(self._instances) - len(self.queue) >= self.config.max_instances:
                iid = self._enqueue(program_hash, args, listener, tenant, priority)
                if recorder is not None:
                    self._attach(self._instances[iid], recorder)
                return iid
            inst = self.warm.take(program_hash) if recorder is None else None
            if inst is not None:
                self._place(inst)  # before it resumes: its first host call may allocate pages
                if not inst.launch(args, listener, tenant):
                    self._unplace(inst)
                    inst = None
            cold = inst is None
            if inst is None:
                inst = self._new_instance(program_hash, args, listener)
                inst.pages.tenant = tenant
                if recorder is not None:
                    self._attach(inst, recorder)
                self._place(inst)
            self.warm.note_launch(cold)  # (once the instance exists, as in `_enqueue`)
            inst.pages.priority = priority
            self._instances[inst.id] = inst
        sched = self.replicas[inst.pages.replica].scheduler
        sched.set_class(inst.id, priority, tenant)
        sched.expect(inst.id)
        if cold:  # its thread is started by the starter's: this thread waits for no GIL hand-over
            self._starter.start_soon(inst)
        return inst.id

    # ---- recordings (host/replay/) ----
    @staticmethod
    def _attach(inst: Instance, recorder: Recorder) -> None:
        """Record `inst`'s calls: here, or in its worker (which sends them before its end)."""
        inst.recorder = recorder
        if not isinstance(inst, RemoteInstance):
            recorder.tap()

    def recording(self, instance_id: str, tenant: str | None = None) -> bytes | None:
        """The recording of an instance launched with `record` (the file `pie-replay` reads) once it
        has ended; None while it runs, for an instance not recorded, unknown, forgotten (older than the
        last `RECORDINGS_KEPT`, host/replay/kept.py), or of another tenant than `tenant` (None: any)."""
        return self.recordings.get(instance_id, tenant)

    # ---- the launch queue: launches past max_instances wait for a slot, by service level ----
    def _enqueue(self, program_hash: str, args: list[str], listener: Callable[[InstanceEvent], None],
                 tenant: str, priority: int = 0) -> str:
        """Queue a launch (lock held): a cold instance, started by `_admit` when a slot frees."""
        inst = self._new_instance(program_hash, args, listener)
        self.warm.note_launch(cold=True)
        inst.pages.tenant = tenant
        inst.pages.priority = priority
        self.queue.push(inst)
        self._instances[inst.id] = inst
        return inst.id

    def _admit(self) -> None:
        """Start the queued launches that are due (host/launch_queue.py)."""
        if not len(self.queue):
            return
        now = time.perf_counter()
        with self._lock:
            start = self.queue.due(len(self._instances), now)
            for inst in start:
                self._place(inst)
        for inst in start:
            sched = self.replicas[inst.pages.replica].scheduler
            sched.set_class(inst.id, inst.pages.priority, inst.pages.tenant)
            sched.expect(inst.id)
            inst.start()

    def _place(self, inst: Instance) -> None:
        """Put a new instance on the least loaded replica whose engine is up (lock held)."""
        r = 0
        if len(self._load) > 1:
            up = [i for i, e in enumerate(self.engines) if e.alive] or list(range(len(self._load)))
            r = min(up, key=lambda i: (self._load[i], -self.replicas[i].pages.free_count))
        inst.pages.replica = r
        self._load[r] += 1

    def _unplace(self, inst: Instance) -> None:
        self._load[inst.pages.replica] -= 1

    def _forget(self, instance_id: str) -> None:
        """The instance blocks on something other than a forward: its replica's scheduler need not wait
        (a warm instance, not launched yet, is on replica 0 until placed)."""
        inst = self._instances.get(instance_id)
        self.replicas[inst.pages.replica if inst is not None else 0].scheduler.forget(instance_id)

    def _engine_died(self, replica: int, reason: str) -> None:
        """On the engine's watcher thread, before it is restarted: the KV cache of that replica is
        gone, so the instances living on it end (their pages come back as they do), and its
        exports and prefix-cache entries are dropped. The other replicas carry on."""
        with self._lock:
            victims = [i for i in self._instances.values() if i.pages.replica == replica]
        then = "the host restarts the engine" if self.engines[replica].restart else "engine_restart is off"
        msg = f"{reason}: its KV cache is lost, the instances on it were ended ({then})"
        for inst in victims:
            inst.terminate(msg)
        dropped = self.replicas[replica].pages.drop_contents()
        log.error("%s; ended %d instance(s), dropped %d export(s)", reason, len(victims), dropped)

    def prewarm(self, program_hash: str, n: int, timeout_s: float = 60.0) -> int:
        """Keep `n` instances of a program started ahead of demand from now on, and wait until
        they are ready (or `timeout_s`); returns how many are. n = 0 stops keeping it warm.
        See host/wasm/warm.py."""
        self.wasm.get(program_hash)
        return self.warm.prewarm(program_hash, n, timeout_s)

    def warm_start(self, wasms: list[bytes], per_program: int | None = None, timeout_s: float = 60.0) -> list[str]:
        """Compile these programs and keep `per_program` instances of each warm (default: an equal share
        of `warm_auto`, at least `warm_instances`), as if each had had that many running at once,
        their pool slots primed first (`WarmPool.prime`); wait until they are ready (or `timeout_s`).
        Returns their hashes. pie-serve readies the standard inferlets so before it serves: a fresh
        host's first burst starts warm. Twice `per_program` slots of each are primed (`WarmPool.ready`)."""
        if per_program is not None and per_program < 0:
            raise ValueError(f"per_program must be >= 0, got {per_program}")
        programs = [self.compile(w) for w in wasms]
        n = per_program if per_program is not None else \
            max(self.config.warm_auto // max(len(programs), 1), self.config.warm_instances)
        self.warm.ready(programs, n, self.wasm.pooling.slots if self.wasm.pooling else None,
                        self.wasm.reaper.wait_drained if self.wasm.reaper is not None else None, timeout_s)
        return programs

    def _get(self, instance_id: str) -> Instance:
        with self._lock:
            inst = self._instances.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return inst

    def signal(self, instance_id: str, message: str) -> None:
        """Deliver a client message to the instance's receive(); InboxFull past `max_inbox_bytes` unread."""
        self._get(instance_id).signal(message)

    def close_input(self, instance_id: str) -> None:
        """From now on the instance's receive() returns none once its inbox is empty."""
        self._get(instance_id).close_input()

    def terminate(self, instance_id: str, reason: str = "terminated by request") -> None:
        """Stop an instance; it ends with an `aborted` event carrying `reason` (a queued launch too)."""
        self._get(instance_id).terminate(reason)
        if instance_id in self.queue:
            self._admit()

    def wait(self, instance_id: str, timeout: float | None = None) -> bool:
        """Block until the instance has ended (its terminal event was emitted); False on timeout."""
        with self._lock:
            inst = self._instances.get(instance_id) or self._ended.get(instance_id)
        if inst is None:
            raise KeyError(f"unknown instance {instance_id!r}")
        return inst.join(timeout)

    def _instance_ended(self, inst: Instance) -> None:
        """On the instance's thread as it ends: release everything it held."""
        with self._lock:
            if self._instances.pop(inst.id, None) is not None:
                self._load[inst.pages.replica] -= 1
            if not inst.parked:  # a warm instance never launched is known to no one
                self._ended[inst.id] = inst
                self.warm.ended(inst.program)
            if len(self._ended) > _ENDED_KEPT:
                self._ended.popitem(last=False)
        self._admit()  # its slot goes to the longest waiting launch
        self.services.release(inst)  # its children, subscriptions, grammars, embedding slots
        with inst.cond:
            inst.published.clear()  # unread messages go with their subscriber
        inst.drop_inbox()  # and unread client messages: an ended instance is kept (for wait) without them,
        inst.args, inst.return_value = [], None  # and without its request (an OpenAI body: up to --max-body-mb)
        self.replicas[inst.pages.replica].release(inst)  # its forwards run, then its pages go back

    def logs(self, instance_id: str, tenant: str | None = None) -> list[dict[str, Any]] | None:
        """The last lines of an instance's runtime.log, stdout and stderr (host/wasm/logs.py), running or
        ended up to LOG_RETENTION_S ago; None for an unknown instance, or one of another tenant than
        `tenant` (None: any)."""
        with self._lock:
            inst = self._instances.get(instance_id) or self._ended.get(instance_id)
        if inst is None or (tenant is not None and inst.pages.tenant != tenant):
            return None
        if inst.ended_at is not None and time.time() - inst.ended_at > LOG_RETENTION_S:
            return None
        return inst.log.entries()

    def ended_instances(self, limit: int = 100) -> list[dict[str, Any]]:
        """The instances that ended up to LOG_RETENTION_S ago, whose logs `logs` still reads, the newest
        first (at most `limit`): id, program, tenant, state (its end event), started_at, ended_at and
        log_lines (the dashboard lists them)."""
        cutoff = time.time() - LOG_RETENTION_S
        with self._lock:
            insts = list(self._ended.values())
        out: list[dict[str, Any]] = []
        for i in reversed(insts):  # (kept in the order they ended)
            if i.ended_at is None or i.ended_at < cutoff or len(out) >= limit:
                break
            out.append({"id": i.id, "program": i.program, "tenant": i.pages.tenant, "state": i.state,
                        "started_at": i.started_at, "ended_at": i.ended_at, "log_lines": len(i.log)})
        return out

    def shutdown(self, timeout: float = 10.0) -> None:
        """Terminate every instance, then stop the scheduler and the epoch ticker."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            insts = list(self._instances.values()) + self.warm.close()
        for inst in insts:
            inst.terminate("host shutting down")
        self._admit()  # queued launches start, to end at once
        for inst in insts:
            inst.join(timeout)
        if self.workers is not None:
            self.workers.close()
        self._starter.close()
        for r in self.replicas:
            if r.suspender is not None:
                r.suspender.stop()
            r.scheduler.stop()
        for eng in self.engines:
            eng.close()
        self.linker.close()
        self.wasm.close()  # instances not joined above keep what they use alive (wasmtime refcounts)
        self.kvstore.close()
        self.http.close()
        self.tuning.restore()

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


def _ignore(_event: InstanceEvent) -> None:
    """The event listener of an instance launched without one (and of a warm one not launched yet)."""
