"""The program store: uploaded inferlet components on disk, content-addressed by sha256.

A program is stored as ``<root>/<sha256>.wasm`` only after the host compiled it, so every stored
file is launchable; files survive restarts and are recompiled (from the host's on-disk cache) on
first launch. `Upload` assembles one chunked upload and checks its hash.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from host.client.protocol import CHUNK_SIZE

__all__ = ["ProgramStore", "Upload", "UploadError", "ProgramRejected", "DEFAULT_MAX_PROGRAM_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PROGRAM_BYTES = 128 * 1024 * 1024


class UploadError(Exception):
    """A chunk that does not fit the upload in progress (order, size, count, hash)."""


class ProgramRejected(Exception):
    """The host refused to compile a program; the message carries the compiler's reason."""


class Upload:
    """One chunked upload in progress: chunks must arrive in order, each at most `CHUNK_SIZE` bytes."""

    def __init__(self, program_hash: str, total_chunks: int, max_bytes: int) -> None:
        max_chunks = -(-max_bytes // CHUNK_SIZE)
        if total_chunks > max_chunks:
            raise UploadError(f"total_chunks {total_chunks} exceeds the limit of {max_chunks} "
                              f"({max_bytes} bytes in chunks of {CHUNK_SIZE})")
        self.program_hash = program_hash
        self.total_chunks = total_chunks
        self.next_index = 0
        self._max_bytes = max_bytes
        self._data = bytearray()

    def add(self, program_hash: str, chunk_index: int, total_chunks: int, chunk: bytes) -> bool:
        """Append one chunk; returns True when it was the last one. Raises `UploadError`."""
        if program_hash != self.program_hash or total_chunks != self.total_chunks:
            raise UploadError(f"chunk {chunk_index} belongs to a different upload (hash {program_hash}, "
                              f"{total_chunks} chunks) than the one in progress "
                              f"(hash {self.program_hash}, {self.total_chunks} chunks)")
        if chunk_index != self.next_index:
            raise UploadError(f"out-of-order chunk: got chunk_index {chunk_index}, expected {self.next_index}")
        if len(chunk) > CHUNK_SIZE:
            raise UploadError(f"chunk {chunk_index} is {len(chunk)} bytes; the limit is {CHUNK_SIZE}")
        if not chunk:
            raise UploadError(f"chunk {chunk_index} is empty")
        if len(self._data) + len(chunk) > self._max_bytes:
            raise UploadError(f"program exceeds the size limit of {self._max_bytes} bytes")
        self._data += chunk
        self.next_index += 1
        return self.next_index == self.total_chunks

    def finish(self) -> bytes:
        """The assembled program after the last chunk; raises `UploadError` if the hash differs."""
        data = bytes(self._data)
        actual = hashlib.sha256(data).hexdigest()
        if actual != self.program_hash:
            raise UploadError(f"hash mismatch: program_hash is {self.program_hash} but the "
                              f"{len(data)} uploaded bytes hash to {actual}")
        return data


class ProgramStore:
    """Compiled-and-accepted programs under `root`, keyed by the sha256 of their bytes.

    `compile_fn` is the host's compile (returns the hash, raises one of `compile_errors` with the
    compiler's reason). It is thread-safe: compiles of one program are serialized.
    """

    def __init__(self, root: Path, compile_fn: Callable[[bytes], str],
                 compile_errors: tuple[type[Exception], ...]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._compile_fn = compile_fn
        self._compile_errors = compile_errors
        self._compiled: set[str] = set()
        self._lock = threading.Lock()
        self._hash_locks: dict[str, threading.Lock] = {}

    def path(self, program_hash: str) -> Path:
        return self.root / f"{program_hash}.wasm"

    def exists(self, program_hash: str) -> bool:
        return self.path(program_hash).is_file()

    def hashes(self) -> list[str]:
        return sorted(p.stem for p in self.root.glob("*.wasm"))

    def put(self, data: bytes) -> str:
        """Compile `data` and store it; a program already stored is left as is. Raises `ProgramRejected`."""
        program_hash = hashlib.sha256(data).hexdigest()
        if self.exists(program_hash):
            return program_hash
        self._compile(program_hash, data)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".part")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self.path(program_hash))  # atomic: a crash never leaves a torn program
        log.info("stored program %s (%d bytes)", program_hash, len(data))
        return program_hash

    def ensure_compiled(self, program_hash: str) -> None:
        """Make a stored program launchable in this host process. Raises KeyError if not stored."""
        if program_hash in self._compiled:
            return
        if not self.exists(program_hash):
            raise KeyError(program_hash)
        self._compile(program_hash, self.path(program_hash).read_bytes())

    def _compile(self, program_hash: str, data: bytes) -> None:
        with self._lock:
            lock = self._hash_locks.setdefault(program_hash, threading.Lock())
        with lock:
            if program_hash in self._compiled:
                return
            try:
                compiled_hash = self._compile_fn(data)
            except self._compile_errors as exc:
                raise ProgramRejected(str(exc)) from exc
            if compiled_hash != program_hash:
                raise RuntimeError(f"host compiled {program_hash} but reported hash {compiled_hash}")
            self._compiled.add(program_hash)
