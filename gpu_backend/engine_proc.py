"""Engine processes: the backend in a process of its own, driven by the host over pyzmq + msgpack.

    backend = ProcessBackend(EngineSpec(page_size=16))     # starts `python -m gpu_backend.engine_proc`
    backend.forward([ForwardRequest(...)])                 # a `Backend`, like TorchBackend

The host keeps the page tables (host/state/pages.py); the engine holds the KV cache and runs
what it is sent. Transport: one zmq PAIR socket over a Unix-domain (ipc://) endpoint; a message is
`[op, payload]` in msgpack (`engine_wire.py`), ops `forward`, `copy`, `logits`, `stop`. The
engine's torch work runs on its own main thread, outside the host's GIL.

With `tp > 1` the engine process is rank 0 of a tensor-parallel group (gpu_backend/tp.py): it
starts ranks 1..tp-1 itself (same module, `--rank`, a `file://` rendezvous in a private temp
dir) or, launched by `torchrun`, joins the group torchrun set up (RANK / WORLD_SIZE in the
environment, `env://` rendezvous).

Faults: the host side watches the process (a pidfd in the same poll as the socket, and a thread
blocked in `wait`), so a dead engine is noticed at once: the forward waiting on it raises
`EngineDied`, the `on_death` callbacks run (the host ends the instances that lived on it), and
the engine is started again (`restart=True`); forwards sent meanwhile wait for the new one.
The engine exits when its parent (the host) dies (rank 0 checks its parent pid every second;
the ranks it starts get SIGTERM when it dies).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .types import BackendInfo, ForwardError, ForwardRequest, OutputResult, Tokenizer
from .validate import check_batch

__all__ = ["EngineDied", "EngineSpec", "ProcessBackend", "start_engines"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading a large model can take minutes
POLL_MS = 1000  # the engine's idle poll (parent check, TP keep-alive)


class EngineDied(RuntimeError):
    """The engine process ended (crashed, killed) or could not be started."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process loads: the model and KV cache (as `load_backend`'s arguments), or the
    model-less stand-in (`standin=True`: gpu_backend/standin.py, for tests and host benchmarks).

    tp: tensor-parallel ranks of this engine; replica: which copy of the model this engine is (picks
    its GPUs: ranks of replica r use cuda:r*tp .. cuda:r*tp+tp-1); threads: torch CPU threads per
    rank (None: the CPU count shared among all ranks of all replicas, at least 1).
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    attention: str = "sdpa"
    tp: int = 1
    replicas: int = 1
    replica: int = 0
    threads: int | None = None
    standin: bool = False
    standin_delay_s: float = 0.0
    standin_vocab: int = 256

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> EngineSpec:
        return cls(**json.loads(s))


def _describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"


# ---------------------------------------------------------------- the host side


@dataclass
class _Proc:
    popen: subprocess.Popen[bytes]
    sock: Any
    pidfd: int | None
    tmpdir: str
    poller: Any = None
    watched: bool = False  # the watcher thread owns its death (set once the engine is up)
    handled: threading.Event = field(default_factory=threading.Event)  # on_death callbacks have run


class ProcessBackend:
    """A `Backend` whose model runs in an engine process (see the module docstring).

    `on_death`: callbacks `fn(reason)` run on the watcher thread as soon as the engine is found
    dead (before it is restarted). `restart`: start a new engine after a death.
    """

    def __init__(self, spec: EngineSpec, *, restart: bool = True, name: str = "engine",
                 ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        import zmq

        self.spec, self.name, self.restart = spec, name, restart
        self.ready_timeout_s = ready_timeout_s
        self.on_death: list[Callable[[str], None]] = []
        self.deaths = 0  # times the engine died (and was restarted, if restart)
        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._lock = threading.Lock()  # one request on the socket at a time
        self._ready = threading.Event()
        self._closing = False
        self._failed: str | None = None  # why the engine is gone for good
        self._proc, hello = self._spawn()
        self._proc.watched = True
        self.info: BackendInfo = hello[0]
        self.tokenizer: Tokenizer = hello[1]
        self._ready.set()
        self._watcher = threading.Thread(target=self._watch, name=f"pie-{name}-watch", daemon=True)
        self._watcher.start()

    # -- the Backend protocol --

    def forward(self, reqs: Sequence[ForwardRequest]) -> list[list[OutputResult]]:
        if not reqs:
            return []
        from .engine_wire import decode_results, encode_requests

        checked = check_batch(reqs, self.info)  # checked requests pass as they are
        return decode_results(self._call("forward", encode_requests(checked)))

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        self._call("copy", [src_page, src_offset, dst_page, dst_offset, count])

    def logits(self, reqs: list[ForwardRequest]) -> list[Any]:
        """Float32 logits of each request's output rows (numpy [outputs, vocab]); writes K/V like forward."""
        import numpy as np

        from .engine_wire import encode_requests

        rows = self._call("logits", encode_requests(reqs))
        return [np.frombuffer(data, dtype=np.float32).reshape(shape) for shape, data in rows]

    # -- process management --

    @property
    def pid(self) -> int:
        return self._proc.popen.pid

    @property
    def alive(self) -> bool:
        return self._ready.is_set() and self._proc.popen.poll() is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until an engine is up (after a restart); False on timeout or if it is gone for good."""
        return self._ready.wait(timeout) and self._failed is None

    def close(self) -> None:
        """Stop the engine (it finishes the request it is running) and its watcher."""
        if self._closing:
            return
        self._closing = True
        proc = self._proc
        with self._lock:
            try:
                if proc.popen.poll() is None:
                    proc.sock.send(_pack(["stop", None]))
                    if proc.sock.poll(5000):
                        proc.sock.recv()
            except Exception as e:  # the engine is going away either way
                log.debug("%s: stop request failed: %s", self.name, e)
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            proc.popen.wait()
        self._ready.clear()
        self._failed = "the engine was shut down"
        self._release(proc)

    def _spawn(self) -> tuple[_Proc, tuple[BackendInfo, Tokenizer]]:
        zmq = self._zmq
        tmpdir = tempfile.mkdtemp(prefix="pie-engine-")
        endpoint = f"ipc://{tmpdir}/engine.sock"
        sock = self._ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(endpoint)  # the host binds: a restarted engine connects to a fresh endpoint
        cmd = [sys.executable, "-m", "gpu_backend.engine_proc", "--spec", self.spec.to_json(),
               "--endpoint", endpoint, "--tmpdir", tmpdir]
        env = dict(os.environ)
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)  # the engine starts its own ranks; a host under torchrun must not leak its rank
        popen = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)
        pidfd = None
        with contextlib.suppress(AttributeError, OSError):
            pidfd = os.pidfd_open(popen.pid)
        proc = _Proc(popen, sock, pidfd, tmpdir)
        proc.poller = zmq.Poller()
        proc.poller.register(sock, zmq.POLLIN)
        if pidfd is not None:
            proc.poller.register(pidfd, zmq.POLLIN)
        try:
            hello = _unpack(self._recv(proc, self.ready_timeout_s, "starting"))
            if hello[0] != "ready":
                raise EngineDied(f"{self.name} failed to start: {hello[1]}")
            if popen.poll() is not None:
                raise EngineDied(f"{self.name} exited right after starting ({_describe_exit(popen.returncode)})")
            return proc, self._hello(hello[1])
        except BaseException:
            if popen.poll() is None:
                popen.kill()
                popen.wait()
            self._release(proc)
            raise

    def _hello(self, payload: dict[str, Any]) -> tuple[BackendInfo, Tokenizer]:
        if payload["kind"] == "standin":
            from .standin import StandInInfo, StandInTokenizer

            return StandInInfo(**payload["info"]), StandInTokenizer()
        from .config import ModelInfo
        from .model_files import TokenizerSpec
        from .tokenizer import Tokenizer as ByteTokenizer

        info = ModelInfo(**payload["info"])
        return info, ByteTokenizer(TokenizerSpec(**payload["tokenizer"]), info.name)

    def _release(self, proc: _Proc) -> None:
        proc.sock.close(linger=0)
        if proc.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(proc.pidfd)
            proc.pidfd = None
        shutil.rmtree(proc.tmpdir, ignore_errors=True)

    def _recv(self, proc: _Proc, timeout_s: float | None, doing: str) -> bytes:
        """The next message from the engine; EngineDied as soon as the process is gone."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        # with a pidfd the poll wakes the moment the process ends; without one, check every 50 ms
        slice_ms = 1000 if proc.pidfd is not None else 50
        while True:
            ready = dict(proc.poller.poll(slice_ms))
            if proc.sock in ready:
                return proc.sock.recv(copy=True)
            if proc.popen.poll() is not None:
                if proc.watched:  # let the watcher tell the host first, so instances end with its reason
                    proc.handled.wait(5.0)
                raise EngineDied(f"{self.name} process {proc.popen.pid} died while {doing} "
                                 f"({_describe_exit(proc.popen.returncode)})")
            if deadline is not None and time.monotonic() > deadline:
                raise EngineDied(f"{self.name} process {proc.popen.pid}: no answer after {timeout_s:.0f} s "
                                 f"while {doing}")

    def _call(self, op: str, payload: Any) -> Any:
        if not self._ready.is_set():
            self._ready.wait(self.ready_timeout_s)
        with self._lock:
            if self._failed is not None:
                raise EngineDied(f"{self.name} is not running: {self._failed}")
            if not self._ready.is_set():
                raise EngineDied(f"{self.name} is restarting after a crash")
            proc = self._proc
            proc.sock.send(_pack([op, payload]), copy=False)
            status, body = _unpack(self._recv(proc, None, f"running {op!r}"))
        if status == "ok":
            return body
        if status == "forward_error":
            raise ForwardError(body[0], body[1])
        kind, message = body
        if kind == "ValueError":
            raise ValueError(message)
        raise RuntimeError(f"{self.name}: {kind}: {message}")

    def _watch(self) -> None:
        """Block on the engine process; when it dies, tell the callbacks and start a new one."""
        while True:
            proc = self._proc
            rc = proc.popen.wait()
            if self._closing:
                return
            self._ready.clear()
            reason = f"{self.name} process {proc.popen.pid} died ({_describe_exit(rc)})"
            self.deaths += 1
            log.error("%s; its KV cache is lost", reason)
            for fn in list(self.on_death):
                try:
                    fn(reason)
                except Exception:
                    log.exception("%s: on_death callback failed", self.name)
            proc.handled.set()
            with self._lock:  # a request in flight has raised EngineDied by now
                self._release(proc)
            if not self.restart or self._closing:
                self._failed = reason
                self._ready.set()  # waiters wake and fail
                return
            try:
                new, _hello = self._spawn()
            except Exception as e:
                self._failed = f"{reason}; restarting it failed: {e}"
                log.error("%s", self._failed)
                self._ready.set()
                return
            new.watched = True
            with self._lock:
                self._proc = new
            log.warning("%s restarted as process %d", self.name, new.popen.pid)
            self._ready.set()


def start_engines(spec: EngineSpec, replicas: int = 1, restart: bool = True) -> list[ProcessBackend]:
    """Start `replicas` engines of `spec` at once (each its own process group of `spec.tp` ranks)."""
    specs = [EngineSpec(**{**asdict(spec), "replicas": replicas, "replica": r}) for r in range(replicas)]
    out: list[ProcessBackend | None] = [None] * replicas
    errors: list[BaseException] = []

    def start(r: int) -> None:
        try:
            out[r] = ProcessBackend(specs[r], restart=restart, name=f"engine {r}" if replicas > 1 else "engine")
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=start, args=(r,)) for r in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = [b for b in out if b is not None]
    if errors:
        for b in started:
            b.close()
        raise errors[0]
    return started


def _pack(obj: Any) -> bytes:
    from .engine_wire import pack

    return pack(obj)


def _unpack(data: bytes) -> Any:
    from .engine_wire import unpack

    return unpack(data)


# ---------------------------------------------------------------- the engine side


def _die_with_parent() -> None:
    """Linux: get SIGTERM when the process that started us dies (no orphaned engines)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _device_for(spec: EngineSpec, local_rank: int) -> str | None:
    import torch

    dev = spec.device
    if dev is None:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cuda":
        need, have = spec.tp * spec.replicas, torch.cuda.device_count()
        if need > have:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise RuntimeError(f"--tp {spec.tp} x --replicas {spec.replicas} needs {need} GPUs, but {have} "
                               f"{'is' if have == 1 else 'are'} visible"
                               f"{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}: "
                               "lower --tp or --replicas, or make more GPUs visible")
        dev = f"cuda:{spec.replica * spec.tp + local_rank}"
    return dev


def _load(spec: EngineSpec, tp: Any, device: str | None) -> Any:
    import torch

    if spec.standin:
        from .standin import StandInBackend

        sb = StandInBackend(page_size=spec.page_size, num_pages=spec.num_pages or 64, delay_s=spec.standin_delay_s)
        return sb
    from .backend import load_backend

    dtype = None if spec.dtype is None else getattr(torch, spec.dtype)
    return load_backend(spec.model, device=device, dtype=dtype, page_size=spec.page_size, num_pages=spec.num_pages,
                        kv_memory_bytes=spec.kv_memory_bytes, progress=False, attention=spec.attention, tp=tp)


def _set_threads(spec: EngineSpec) -> None:
    import torch

    n = spec.threads or max(1, (os.cpu_count() or 1) // max(1, spec.tp * spec.replicas))
    torch.set_num_threads(n)


def _hello_payload(spec: EngineSpec, backend: Any) -> dict[str, Any]:
    if spec.standin:
        return {"kind": "standin", "info": asdict(backend.info)}
    tok = backend.tokenizer
    return {"kind": "model", "info": asdict(backend.info), "tokenizer": asdict(tok.spec)}


def _serve(spec: EngineSpec, endpoint: str, backend: Any, tp: Any) -> None:
    """Rank 0: answer the host's requests until `stop` or until the host goes away."""
    import zmq

    from .engine_wire import decode_requests, encode_results, pack, unpack

    ctx: Any = zmq.Context.instance()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(endpoint)
    gc.collect()  # the model, torch and the wire live as long as this process: keep them out of
    gc.freeze()  # every later full collection (~100 ms each with all of torch tracked; host/host.py)
    sock.send(pack(["ready", _hello_payload(spec, backend)]))
    parent = os.getppid()
    idle_since = time.monotonic()
    tp_on = tp is not None and tp.world > 1
    while True:
        if not sock.poll(POLL_MS):
            if os.getppid() != parent:
                log.warning("engine: the host went away; exiting")
                return
            if tp_on and time.monotonic() - idle_since > 60.0:
                backend.ping()  # keeps the other ranks' waits from timing out
                idle_since = time.monotonic()
            continue
        op, payload = unpack(sock.recv())
        fatal = False
        try:
            if op == "forward":
                reply: list[Any] = ["ok", encode_results(backend.forward(decode_requests(payload)))]
            elif op == "copy":
                backend.copy_tokens(*payload)
                reply = ["ok", None]
            elif op == "logits":
                out = backend.logits(decode_requests(payload))
                reply = ["ok", [[list(t.shape), t.float().cpu().numpy().tobytes()] for t in out]]
            elif op == "stop":
                sock.send(pack(["ok", None]))
                return
            else:
                reply = ["error", ["ValueError", f"unknown engine op {op!r}"]]
        except ForwardError as e:
            reply = ["forward_error", [e.request_index, str(e)]]
        except ValueError as e:  # a request rejected before anything ran
            reply = ["error", ["ValueError", str(e)]]
        except Exception as e:
            log.exception("engine: %s failed", op)
            reply = ["error", [type(e).__name__, str(e)]]
            fatal = tp_on  # a failure inside a collective leaves the group out of step: start over
        sock.send(pack(reply))
        idle_since = time.monotonic()
        if fatal:
            log.error("engine: tensor-parallel group out of step after an error; exiting so the host restarts it")
            os._exit(70)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpu_backend.engine_proc",
                                 description="A pie engine process (started by the host, or by torchrun)")
    ap.add_argument("--spec", required=True, help="EngineSpec as JSON")
    ap.add_argument("--endpoint", help="rank 0: the host's zmq endpoint")
    ap.add_argument("--tmpdir", help="private directory for the rendezvous file")
    ap.add_argument("--rank", type=int, default=0, help="this rank (started by rank 0)")
    ap.add_argument("--init", help="rendezvous (init_method) of the tensor-parallel group")
    args = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("PIE_ENGINE_LOG", "WARNING"),
                        format=f"%(levelname)s engine[rank {args.rank}] %(name)s: %(message)s")
    if args.rank != 0:
        # PR_SET_PDEATHSIG fires when the *thread* that started us ends: fine for ranks started by
        # rank 0's main thread; rank 0 itself (started from any host thread) polls its parent pid
        _die_with_parent()
    spec = EngineSpec.from_json(args.spec)
    if not spec.standin:
        _set_threads(spec)
    tp = None
    workers: list[subprocess.Popen[bytes]] = []
    rank, local_rank, init = args.rank, args.rank, args.init
    from .tp import env_rank, init_tp

    launched = env_rank()
    if launched is not None:  # torchrun: it started every rank and set up the rendezvous
        rank, world, local_rank = launched
        if world != spec.tp:
            print(f"engine: WORLD_SIZE={world} but the spec asks for tp={spec.tp}", file=sys.stderr)
            return 2
        init = "env://"
    try:
        device = _device_for(spec, local_rank) if not spec.standin else "cpu"
    except RuntimeError as e:
        print(f"engine: {e}", file=sys.stderr)
        if rank == 0 and args.endpoint:
            _send_failure(args.endpoint, str(e))
        return 1
    if spec.tp > 1:
        import torch

        if device is not None and device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        if rank == 0 and launched is None:
            assert args.tmpdir is not None
            init = f"file://{args.tmpdir}/tp-rendezvous"
            for r in range(1, spec.tp):
                workers.append(subprocess.Popen(
                    [sys.executable, "-m", "gpu_backend.engine_proc", "--spec", args.spec, "--rank", str(r),
                     "--init", init], stdin=subprocess.DEVNULL))
        assert init is not None
        if workers:
            threading.Thread(target=_watch_workers, args=(workers,), daemon=True).start()
        tp = init_tp(rank, spec.tp, init, "cuda" if device and device.startswith("cuda") else "cpu")
    try:
        try:
            backend = _load(spec, tp, device)
        except Exception as e:
            log.exception("engine: loading failed")
            if rank == 0 and args.endpoint:
                _send_failure(args.endpoint, f"{type(e).__name__}: {e}")
            return 1
        if rank != 0:
            from .tp import TPWorker

            assert tp is not None
            TPWorker(backend, tp).serve()
            return 0
        if not args.endpoint:
            print("engine: rank 0 needs --endpoint", file=sys.stderr)
            return 2
        _serve(spec, args.endpoint, backend, tp)
        if tp is not None:
            backend.stop_workers()
        return 0
    finally:
        for w in workers:
            try:
                w.wait(timeout=10)
            except subprocess.TimeoutExpired:
                w.kill()
        if tp is not None:
            import torch.distributed as dist

            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def _watch_workers(workers: list[subprocess.Popen[bytes]]) -> None:
    """Rank 0: a rank that dies leaves every collective hanging: exit at once, so the host sees the
    engine die and starts the whole group again."""
    while True:
        for w in workers:
            rc = w.poll()
            if rc is not None and rc != 0:
                log.error("engine: rank process %d died (%s); exiting", w.pid, _describe_exit(rc))
                os._exit(71)
        time.sleep(0.05)


def _send_failure(endpoint: str, message: str) -> None:
    import zmq

    from .engine_wire import pack

    sock: Any = zmq.Context.instance().socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(endpoint)
    sock.send(pack(["failed", message]))
    sock.close()


if __name__ == "__main__":
    sys.exit(main())
