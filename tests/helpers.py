"""Shared helpers for host tests: building inferlets, loading the real model once, running instances."""

from __future__ import annotations

import functools
import importlib.util
import queue
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from types import ModuleType
from typing import Any

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
            elif ev.event == "message":
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


def hf_default_tokenizer():  # type: ignore[no-untyped-def]
    """transformers' tokenizer for the default model, as `AutoTokenizer.from_pretrained(gguf_file=...)`
    makes it (the independent reference for ours), converted from the GGUF once and kept on disk.

    Why: the conversion reads the GGUF's vocabulary in Python, ~5 s each time; test modules that
    each made it cost make test-fast ~15 s of its minute. The saved tokenizer.json is the
    conversion's own output, reloaded by transformers."""
    import fcntl
    import hashlib

    import transformers

    from gpu_backend.loading.loader import default_model_path
    from host.config import default_cache_dir

    path = default_model_path()
    st = path.stat()
    key = hashlib.sha256(f"{path.name}:{st.st_size}:{st.st_mtime_ns}:{transformers.__version__}".encode()).hexdigest()
    cache = default_cache_dir() / "test-hf-tokenizer" / key[:24]
    cache.parent.mkdir(parents=True, exist_ok=True)
    with open(cache.parent / f"{key[:24]}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # pytest-xdist workers: one converts, the others wait
        if not (cache / "tokenizer.json").is_file():
            tok = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
            tmp = cache.with_name(cache.name + ".tmp")
            tok.save_pretrained(tmp)
            tmp.replace(cache)
    return transformers.AutoTokenizer.from_pretrained(cache)


def text_completion_burst(host: Host, program: str, prompts: list[str], max_tokens: int,
                          launching: Callable[[], AbstractContextManager[Any]] = nullcontext) \
        -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """`text_completion` launched for every prompt at once in front of a `FakeBackend` (each token the
    last one + 1, mod 256); returns each instance's (end event, message) and the expected ones,
    computed from the fake's tokenizer and chat template. The launches come one right after the
    other (the expected outputs are computed first), inside `launching()`."""
    tok = host.backend.tokenizer
    wants = []
    for p in prompts:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], True))
        wants.append(("completed", tok.decode([(ids[-1] + 1 + j) % 256 for j in range(max_tokens)])))
    with launching():
        runs = [Run(host, program, ["--prompt", p, "--max-tokens", str(max_tokens)]) for p in prompts]
    got = []
    for r in runs:
        ev = r.finish(120)
        got.append((ev.event, ev.message))
    return got, wants
