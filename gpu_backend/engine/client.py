"""Engine processes: the backend in a process of its own, driven by the host over pyzmq + msgpack.

    backend = ProcessBackend(EngineSpec(page_size=16))     # starts `python -m gpu_backend.engine.server`
    backend.forward([ForwardRequest(...)])                 # a `Backend`, like TorchBackend

The host keeps the page tables (host/state/pages.py); the engine holds the KV cache and runs
what it is sent. Transport: one zmq PAIR socket over a Unix-domain (ipc://) endpoint; a message is
`[op, payload]` in msgpack (`engine_wire.py`), ops `forward`, `copy`, `logits`, `stop`. The
engine's torch work runs on its own main thread, outside the host's GIL.

With `tp > 1` the engine process is rank 0 of a tensor-parallel group (gpu_backend/engine/tp.py): it
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

import contextlib
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gpu_backend.engine.spec import EngineDied, EngineSpec, describe_exit
from gpu_backend.types import BackendInfo, ForwardError, ForwardRequest, OutputResult, Tokenizer
from gpu_backend.validate import check_batch

# (EngineDied and EngineSpec from gpu_backend/engine/spec.py, for the backend's users)
__all__ = ["EngineDied", "EngineSpec", "ProcessBackend", "start_engines"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 600.0  # loading a large model can take minutes


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


class EngineSwap:
    """Pages an engine swapped out, kept in the engine process under `id` (-1 once swapped back in)."""

    def __init__(self, backend: ProcessBackend, handle: int) -> None:
        self.backend, self.id = backend, handle

    def __del__(self) -> None:
        if self.id >= 0:
            self.backend._swap_dropped_later(self.id)


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
        # 0: the engine cannot swap pages out (tensor parallel); the host then suspends nobody
        self.swap_page_bytes: int = self._swap_page_bytes
        self._swap_ids = itertools.count(1)
        self._swap_lock = threading.Lock()
        self._swap_dropped: list[int] = []
        self._ready.set()
        self._watcher = threading.Thread(target=self._watch, name=f"pie-{name}-watch", daemon=True)
        self._watcher.start()

    # -- the Backend protocol --

    def forward(self, reqs: Sequence[ForwardRequest]) -> list[list[OutputResult]]:
        if not reqs:
            return []
        from gpu_backend.engine.wire import decode_results, encode_requests

        checked = check_batch(reqs, self.info)  # checked requests pass as they are
        return decode_results(self._call("forward", encode_requests(checked)))

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        self._call("copy", [src_page, src_offset, dst_page, dst_offset, count])

    # -- embeddings (WIT embed, host/api/embed.py): the engine's embedding table and vision tower --

    def input_embeddings(self, tokens: Sequence[int]) -> bytes:
        """The model's input vectors of `tokens`, float32 little-endian [len(tokens), hidden_size]."""
        return bytes(self._call("input_embeddings", [int(t) for t in tokens]))

    def embed_image(self, data: bytes, media_type: str) -> bytes:
        """An image through the engine's vision tower, float32 little-endian [image_tokens, hidden_size];
        ValueError when it does not decode, is too large, or the model has no tower."""
        return bytes(self._call("embed_image", [bytes(data), media_type]))

    # -- swapping pages out (gpu_backend.types.SwapsPages): the copies stay in the engine process --

    def swap_out(self, pages: Sequence[int]) -> EngineSwap:
        """Have the engine copy `pages`' K/V into its own host memory; the handle brings it back."""
        handle = EngineSwap(self, next(self._swap_ids))
        with self._swap_lock:
            dropped, self._swap_dropped = self._swap_dropped, []
        self._call("swap_out", [handle.id, list(pages), dropped])
        return handle

    def swap_in(self, swapped: object, pages: Sequence[int]) -> None:
        assert isinstance(swapped, EngineSwap)
        swapped.id, handle = -1, swapped.id  # taken: nothing to drop later
        self._call("swap_in", [handle, list(pages)])

    def _swap_dropped_later(self, handle: int) -> None:
        """A copy the host no longer needs (its instance ended while suspended): freed in the engine
        with the next swap_out (no socket traffic from a finalizer)."""
        with self._swap_lock:
            self._swap_dropped.append(handle)

    def logits(self, reqs: list[ForwardRequest]) -> list[Any]:
        """Float32 logits of each request's output rows (numpy [outputs, vocab]); writes K/V like forward."""
        import numpy as np

        from gpu_backend.engine.wire import encode_requests

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
        cmd = [sys.executable, "-m", "gpu_backend.engine.server", "--spec", self.spec.to_json(),
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
                raise EngineDied(f"{self.name} exited right after starting ({describe_exit(popen.returncode)})")
            return proc, self._hello(hello[1])
        except BaseException:
            if popen.poll() is None:
                popen.kill()
                popen.wait()
            self._release(proc)
            raise

    def _hello(self, payload: dict[str, Any]) -> tuple[BackendInfo, Tokenizer]:
        self._swap_page_bytes = int(payload.get("swap_page_bytes", 0))
        if payload["kind"] == "standin":
            from gpu_backend.standin import StandInInfo, StandInTokenizer

            return StandInInfo(**payload["info"]), StandInTokenizer()
        from gpu_backend.loading.model_files import TokenizerSpec
        from gpu_backend.loading.tokenizer import Tokenizer as ByteTokenizer
        from gpu_backend.models.config import ModelInfo

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
                                 f"({describe_exit(proc.popen.returncode)})")
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
            reason = f"{self.name} process {proc.popen.pid} died ({describe_exit(rc)})"
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
    from gpu_backend.engine.wire import pack

    return pack(obj)


def _unpack(data: bytes) -> Any:
    from gpu_backend.engine.wire import unpack

    return unpack(data)
