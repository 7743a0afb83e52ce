"""Shared helpers for host tests: building inferlets, loading the real model once, running instances."""

from __future__ import annotations

import functools
import importlib.util
import queue
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import wasmtime

from host import Host
from host.cli.build import resolve_inferlet
from host.events import InstanceEvent

TESTS = Path(__file__).parent
FIXTURES = TESTS / "fixtures"
TERMINAL = ("completed", "exception", "aborted", "out_of_resources")


def load_app(name: str, module_name: str) -> ModuleType:
    """A standard inferlet's app.py imported as a fresh module (against whatever host is bound)."""
    spec = importlib.util.spec_from_file_location(module_name, TESTS.parent / "inferlets" / name / "app.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@functools.cache
def wasm_bytes(name: str) -> bytes:
    """A fixture: `foo.wat` text compiled to a component, or an inferlet (folder/standard name) built."""
    wat = FIXTURES / f"{name}.wat"
    if wat.is_file():
        return bytes(wasmtime.wat2wasm(wat.read_text()))
    src = FIXTURES / name
    return resolve_inferlet(src if src.is_dir() else name, quiet=True).read_bytes()


class Run:
    """Collects one instance's events."""

    def __init__(self, host: Host, program: str, args: list[str], tenant: str = "local") -> None:
        self.events: queue.Queue[InstanceEvent] = queue.Queue()
        self.messages: list[str] = []
        self.host = host
        self.id = host.launch(program, args, self.events.put, tenant=tenant)
        self.end: InstanceEvent | None = None

    def finish(self, timeout: float = 120.0) -> InstanceEvent:
        while self.end is None:
            ev = self.events.get(timeout=timeout)
            if ev.event in TERMINAL:
                self.end = ev
            else:
                self.messages.append(ev.message)
        return self.end


def run_to_end(host: Host, program: str, args: list[str], timeout: float = 120.0) -> InstanceEvent:
    return Run(host, program, args).finish(timeout)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    """Wait until `predicate()` holds (for state that has no event to wait on); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)
