"""A scripted stand-in for `host.Host` (the methods the server calls) and helpers for the server tests.

Programs are any bytes starting with the wasm magic. An instance runs the script named by its
first argument, on its own thread, emitting events through `on_event` like the real host:
  echo W...        send each word, complete with "done"
  gated G W...     wait until the test calls `host.open_gate(G)`, then like echo
  flood N S        send N messages of S bytes;  later G N S: the same once gate G opens
  chat             reply "got:<m>" to each signal; "quit" completes "bye"; closed input completes "eof"
  hold             hold its pages until terminated
  crash            end with an exception;  oom: end out_of_resources
  {...}            an OpenAI request (the handler's argument): answer like openai_chat, "Hello" per
                   choice; the last message's content picks a variant: "hold" waits until
                   terminated, "flood N" streams N deltas of 4 KiB ("flood N hold": then waits
                   until terminated), "crash" traps with a backtrace
Each instance holds 2 KV pages while it runs, so leaks show in `free_pages()`. A script that
raises ends its instance with an `exception` event naming the error, so a test sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
from websockets.asyncio.client import connect

from host.events import InstanceEvent
from host.server import Server, ServerConfig

__all__ = ["WASM", "PAGES_PER_INSTANCE", "FakeCompileError", "FakeHost", "PeakRss", "running_server", "exchange"]

WASM = b"\0asm\x0d\x00\x01\x00fake component"
PAGES_PER_INSTANCE = 2


class FakeCompileError(Exception):
    pass


class _FakeInstance:
    def __init__(self, host: FakeHost, program: str, args: list[str], on_event: Callable[[InstanceEvent], None]) -> None:
        self.id = str(uuid.uuid4())
        self.host, self.program, self.args, self.on_event = host, program, args, on_event
        self.inbox: deque[str] = deque()
        self.input_closed = False
        self.stop_reason: str | None = None
        self.cond = threading.Condition()
        self.started_at = time.time()
        self.thread = threading.Thread(target=self._main, daemon=True)

    def emit(self, event: str, message: str) -> None:
        self.on_event(InstanceEvent(self.id, event, message))

    def _wait(self, ready: Callable[[], bool]) -> None:
        """Block until `ready()` or terminate (which raises InterruptedError)."""
        with self.cond:
            while not ready() and self.stop_reason is None:
                self.cond.wait()
            if self.stop_reason is not None:
                raise InterruptedError

    def receive(self) -> str | None:
        self._wait(lambda: bool(self.inbox) or self.input_closed)
        with self.cond:
            return self.inbox.popleft() if self.inbox else None

    def _main(self) -> None:
        try:
            event, message = self._script()
        except InterruptedError:
            event, message = "aborted", self.stop_reason or ""
        except Exception as exc:  # a bug in a script must fail the test, not hang it
            event, message = "exception", f"fake script failed: {exc!r}"
        with self.host.lock:
            self.host.running.pop(self.id)
            self.host.free += PAGES_PER_INSTANCE
        self.emit(event, message)

    def _echo(self, words: list[str]) -> tuple[str, str]:
        for word in words:
            self.emit("message", word)
        return "completed", "done"

    def _openai(self, req: dict[str, Any]) -> tuple[str, str]:
        last = (req["messages"] or [{}])[-1].get("content", "") if req.get("messages") else req.get("prompt") or ""
        if not isinstance(last, str):  # a prompt of token ids, a null or multi-part content
            last = ""
        if last.startswith("gated "):  # "gated G <rest>": wait until gate G opens, then like <rest>
            _, gate, last = last.split(" ", 2)
            self._wait(lambda: gate in self.host.open_gates)
        if last == "hold":
            self._wait(lambda: False)
        if last == "crash":
            return "exception", "trap: wasm backtrace:\n    0: 0x1234 - <unknown>!inferlet::main\nRust panic"
        deltas = ["x" * 4096] * int(last.split()[1]) if last.startswith("flood ") else ["Hel", "lo"]
        for i in range(req["n"]):
            if req["stream"]:
                for d in deltas:
                    self.emit("message", json.dumps({"index": i, "delta": d}))
                    if self.stop_reason is not None:
                        raise InterruptedError
            if last.endswith(" hold"):
                self._wait(lambda: False)
            self.emit("message", json.dumps({"index": i, "text": "".join(deltas), "finish_reason": "stop",
                                             "completion_tokens": len(deltas)}))
        self.emit("message", json.dumps({"usage": {"prompt_tokens": 4, "completion_tokens": 2 * req["n"]}}))
        return "completed", ""

    def _script(self) -> tuple[str, str]:
        if self.args and self.args[0].startswith("{"):
            return self._openai(json.loads(self.args[0]))
        cmd, rest = (self.args[0], self.args[1:]) if self.args else ("echo", [])
        if cmd == "echo":
            return self._echo(rest)
        if cmd == "gated":
            self._wait(lambda: rest[0] in self.host.open_gates)
            return self._echo(rest[1:])
        if cmd == "later":  # later G N S: when gate G opens, flood N messages of S bytes
            self._wait(lambda: rest[0] in self.host.open_gates)
            for _ in range(int(rest[1])):
                self.emit("message", "x" * int(rest[2]))
            return "completed", "done"
        if cmd == "flood":  # many large messages, as fast as possible
            for _ in range(int(rest[0])):
                self.emit("message", "x" * int(rest[1]))
            return "completed", "done"
        if cmd == "chat":
            while (msg := self.receive()) is not None:
                if msg == "quit":
                    return "completed", "bye"
                self.emit("message", f"got:{msg}")
            return "completed", "eof"
        if cmd == "hold":
            self._wait(lambda: False)  # returns only by raising InterruptedError on terminate
            raise AssertionError("unreachable")
        if cmd == "crash":
            return "exception", "trap: boom"
        if cmd == "oom":
            return "out_of_resources", "out of KV pages"
        return "exception", f"unknown script {cmd!r}"


class FakeHost:
    """The `HostFacade` methods of `host.Host` (and `free_pages`, `shutdown`); no model, no wasm."""

    def __init__(self, total_pages: int = 256, max_running: int | None = None) -> None:
        self.total_pages = total_pages
        self.max_running = max_running  # like HostConfig.max_instances: past it launch raises HostBusy
        self.free = total_pages
        self.lock = threading.Lock()
        self.programs: set[str] = set()
        self.compile_calls = 0
        self.running: dict[str, _FakeInstance] = {}
        self.tenants: dict[str, str] = {}  # instance id -> the tenant it was launched for
        self.terminations: list[tuple[str, str]] = []
        self.open_gates: set[str] = set()
        self.args_seen: list[str] = []  # each launch's first argument

    def compile(self, wasm: bytes) -> str:
        self.compile_calls += 1
        if not wasm.startswith(b"\0asm"):
            raise FakeCompileError(f"input bytes aren't valid utf-8 or a wasm binary: starts with {wasm[:4]!r}")
        h = hashlib.sha256(wasm).hexdigest()
        self.programs.add(h)
        return h

    def launch(self, program_hash: str, args: list[str], on_event: Callable[[InstanceEvent], None],
               tenant: str = "local") -> str:
        if program_hash not in self.programs:
            raise KeyError(program_hash)
        if self.max_running is not None and len(self.running) >= self.max_running:
            from host.host import HostBusy

            raise HostBusy(f"the host is running its maximum of {self.max_running} instances; try again later")
        inst = _FakeInstance(self, program_hash, list(args), on_event)
        self.tenants[inst.id] = tenant
        self.args_seen.append(args[0] if args else "")
        with self.lock:
            self.running[inst.id] = inst
            self.free -= PAGES_PER_INSTANCE
        inst.thread.start()
        return inst.id

    def open_gate(self, name: str) -> None:
        """Let instances running `gated <name> ...` go on."""
        with self.lock:
            self.open_gates.add(name)
            waiting = list(self.running.values())
        for inst in waiting:
            with inst.cond:
                inst.cond.notify_all()

    def _get(self, iid: str) -> _FakeInstance:
        with self.lock:
            return self.running[iid]

    def signal(self, instance_id: str, message: str) -> None:
        inst = self._get(instance_id)
        with inst.cond:
            inst.inbox.append(message)
            inst.cond.notify_all()

    def close_input(self, instance_id: str) -> None:
        inst = self._get(instance_id)
        with inst.cond:
            inst.input_closed = True
            inst.cond.notify_all()

    def terminate(self, instance_id: str, reason: str = "terminated by request") -> None:
        inst = self._get(instance_id)
        self.terminations.append((instance_id, reason))
        with inst.cond:
            inst.stop_reason = reason
            inst.cond.notify_all()

    def instances(self) -> list[dict[str, Any]]:
        with self.lock:
            return [{"id": i.id, "program": i.program, "arguments": i.args, "state": "running",
                     "started_at": i.started_at, "tenant": self.tenants[i.id]} for i in self.running.values()]

    def stats(self) -> dict[str, Any]:
        return {"free_pages": self.free, "total_pages": self.total_pages, "instances": len(self.running)}

    def model_names(self) -> list[str]:
        return ["fake-model"]

    def free_pages(self) -> int:
        return self.free

    def shutdown(self) -> None:
        for iid in list(self.running):
            self.terminate(iid, "host shutting down")


@contextlib.contextmanager
def running_server(data_dir: Path, host: Any = None, openai: bool = False, **config: Any) -> Iterator[Server]:
    """A `Server` on a free port in a background thread, stopped on exit. With `openai`, it serves
    the OpenAI routes too, model "fake-model", handled by the fake host's OpenAI script."""
    host = host if host is not None else FakeHost()
    errors = (FakeCompileError,) if isinstance(host, FakeHost) else None
    program = host.compile(WASM) if openai else None
    server = Server(host, ServerConfig(port=0, data_dir=data_dir, **config), compile_errors=errors,
                    openai_program=program)
    server.start_background()
    try:
        yield server
    finally:
        server.stop_background()


async def exchange(url: str, frame: bytes | str) -> dict[str, Any]:
    """Send one frame on a fresh connection and return the server's reply."""
    async with connect(url) as ws:
        await ws.send(frame)
        return msgpack.unpackb(await asyncio.wait_for(ws.recv(), 5), raw=False)


def _fixed_mmap_threshold() -> None:
    """glibc raises its mmap threshold each time an mmapped block is freed (up to 32 MiB), after which
    blocks of a MB come from the heap and their memory stays resident once freed: the peak would
    count what the process let go of. A fixed 128 KiB threshold keeps such blocks mmapped, so RSS
    follows what is alive (Linux / glibc only; elsewhere nothing)."""
    import ctypes
    import sys

    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):
            pass


class PeakRss:
    """The largest resident set size of this process (the server runs in it) while in the block,
    sampled every 5 ms; `growth` is that peak minus the size at entry, in bytes."""

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRss:
        import gc

        _fixed_mmap_threshold()
        gc.collect()
        self.start = self.peak = self._proc.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start
