"""The program store: uploaded inferlet components on disk, content-addressed by sha256, owned per tenant.

A program is stored as ``<root>/<sha256>.wasm`` only after the host compiled it, so every stored
file is launchable; files survive restarts and are recompiled (from the host's on-disk cache) on
first launch. Each tenant sees and launches only the programs it uploaded (the admin identity
sees all): an owner marker ``<root>/owners/<tenant>/<sha256>`` records that a tenant uploaded a
program, and its mtime when the tenant last uploaded or launched it. Two tenants uploading the
same bytes share one file; each still has to upload the bytes itself.

Bounds: a tenant's programs take at most `quota_bytes` (an upload past it evicts that tenant's
least recently used programs first; one larger than the quota is refused), a program nobody
launched or uploaded for `ttl_s` is evicted from that tenant's set, and a file no tenant owns any
more is deleted. `Upload` assembles one chunked upload and checks its hash; `UploadBudget` bounds
the bytes all partial uploads of a server hold, and each tenant's share of them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from host.client.protocol import CHUNK_SIZE

__all__ = ["ProgramStore", "Upload", "UploadBudget", "UploadError", "ProgramRejected", "ProgramTooLarge",
           "DEFAULT_MAX_PROGRAM_BYTES", "DEFAULT_STORE_BYTES_PER_TENANT", "DEFAULT_PROGRAM_TTL_S",
           "DEFAULT_UPLOAD_BYTES_IN_FLIGHT", "TENANT_NAME_RE"]

log = logging.getLogger(__name__)

DEFAULT_MAX_PROGRAM_BYTES = 128 * 1024 * 1024
DEFAULT_STORE_BYTES_PER_TENANT = 1024 * 1024 * 1024
DEFAULT_PROGRAM_TTL_S = 7 * 24 * 3600.0
DEFAULT_UPLOAD_BYTES_IN_FLIGHT = 512 * 1024 * 1024
# Tenant names become directory names under owners/: nothing that could leave the directory.
TENANT_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_HASH_RE = re.compile(r"[0-9a-f]{64}")
_TOUCH_EVERY_S = 60.0  # a launch refreshes its owner marker's mtime at most this often
_SWEEP_EVERY_S = 60.0  # stale programs are looked for at most this often


class UploadError(Exception):
    """A chunk that does not fit the upload in progress (order, size, count, hash, budget)."""


class ProgramRejected(Exception):
    """The host refused to compile a program, or it cannot be stored; the message says why."""


class ProgramTooLarge(Exception):
    """A program larger than a tenant's whole store quota."""


class UploadBudget:
    """Bytes held by all partial uploads of one server; a chunk past `limit` is refused, and so is
    one that would take its tenant past `tenant_share` (default: half of `limit`, but never less
    than `min_share`, the largest program allowed, so one big upload still fits), so that one
    tenant's connections cannot hold the whole budget and keep everyone else from uploading."""

    def __init__(self, limit: int, tenant_share: int | None = None, min_share: int = 0) -> None:
        self.limit = limit
        self.tenant_share = min(limit, tenant_share if tenant_share is not None else max(limit // 2, min_share))
        self.used = 0
        self.by_tenant: dict[str, int] = {}

    def take(self, n: int, tenant: str = "local") -> None:
        held = self.by_tenant.get(tenant, 0)
        if held + n > self.tenant_share:
            raise UploadError(f"tenant {tenant!r} holds {held} bytes of partial uploads, its share of the "
                              f"server's is {self.tenant_share} (half of --max-uploads-mb, at least "
                              "--max-program-mb); finish or abandon an upload, or try again later")
        if self.used + n > self.limit:
            raise UploadError(f"the server holds {self.used} bytes of partial uploads, its limit is "
                              f"{self.limit} (--max-uploads-mb); try again later")
        self.used += n
        self.by_tenant[tenant] = held + n

    def give(self, n: int, tenant: str = "local") -> None:
        self.used -= n
        left = self.by_tenant.get(tenant, 0) - n
        if left > 0:
            self.by_tenant[tenant] = left
        else:
            self.by_tenant.pop(tenant, None)


class Upload:
    """One chunked upload in progress: chunks must arrive in order, each at most `CHUNK_SIZE` bytes.

    Its bytes count against `budget` until `finish` or `discard`."""

    def __init__(self, program_hash: str, total_chunks: int, max_bytes: int, budget: UploadBudget | None = None,
                 tenant: str = "local") -> None:
        max_chunks = -(-max_bytes // CHUNK_SIZE)
        if total_chunks > max_chunks:
            raise UploadError(f"total_chunks {total_chunks} exceeds the limit of {max_chunks} "
                              f"({max_bytes} bytes in chunks of {CHUNK_SIZE})")
        self.program_hash = program_hash
        self.total_chunks = total_chunks
        self.next_index = 0
        self._max_bytes = max_bytes
        self._budget = budget or UploadBudget(max_bytes)
        self.tenant = tenant  # whose share of the budget its bytes count against
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
        self._budget.take(len(chunk), self.tenant)
        self._data += chunk
        self.next_index += 1
        return self.next_index == self.total_chunks

    def finish(self) -> bytes:
        """The assembled program after the last chunk; raises `UploadError` if the hash differs."""
        data = bytes(self._data)
        self.discard()
        actual = hashlib.sha256(data).hexdigest()
        if actual != self.program_hash:
            raise UploadError(f"hash mismatch: program_hash is {self.program_hash} but the "
                              f"{len(data)} uploaded bytes hash to {actual}")
        return data

    def discard(self) -> None:
        """Let go of the bytes received so far (and their share of the budget)."""
        self._budget.give(len(self._data), self.tenant)
        self._data = bytearray()


class ProgramStore:
    """Compiled-and-accepted programs under `root`, keyed by the sha256 of their bytes, owned per tenant.

    `compile_fn` is the host's compile (returns the hash, raises one of `compile_errors` with the
    compiler's reason). Thread-safe: compiles of one program are serialized, the owner index is
    guarded by a lock.
    """

    def __init__(self, root: Path, compile_fn: Callable[[bytes], str],
                 compile_errors: tuple[type[Exception], ...], quota_bytes: int = DEFAULT_STORE_BYTES_PER_TENANT,
                 ttl_s: float = DEFAULT_PROGRAM_TTL_S, clock: Callable[[], float] = time.time) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.quota_bytes = quota_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._compile_fn = compile_fn
        self._compile_errors = compile_errors
        self._compiled: set[str] = set()
        self._lock = threading.Lock()
        self._hash_locks: dict[str, threading.Lock] = {}
        self._owners = self.root / "owners"
        self._used: dict[str, dict[str, float]] = {}  # tenant -> program -> last upload or launch
        self._sizes: dict[str, int] = {}
        self._touched: dict[tuple[str, str], float] = {}
        self._last_sweep = 0.0
        self._load()

    # ---- queries ----
    def path(self, program_hash: str) -> Path:
        return self.root / f"{program_hash}.wasm"

    def exists(self, program_hash: str) -> bool:
        """Stored for some tenant (a check for tests and stats, not for clients: see `visible`)."""
        return _HASH_RE.fullmatch(program_hash) is not None and self.path(program_hash).is_file()

    def visible(self, tenant: str, program_hash: str, admin: bool = False) -> bool:
        """`tenant` uploaded this program (the admin sees every stored program)."""
        with self._lock:
            if admin:
                return program_hash in self._sizes
            return program_hash in self._used.get(tenant, {})

    def hashes(self) -> list[str]:
        with self._lock:
            return sorted(self._sizes)

    def count(self, tenant: str) -> int:
        """How many programs `tenant` has stored."""
        with self._lock:
            return len(self._used.get(tenant, {}))

    def tenant_bytes(self, tenant: str) -> int:
        """The bytes of the programs `tenant` owns (what its quota counts)."""
        with self._lock:
            return sum(self._sizes[h] for h in self._used.get(tenant, {}))

    # ---- changes ----
    def put(self, data: bytes, tenant: str = "local") -> str:
        """Compile `data`, store it and make `tenant` an owner. Raises `ProgramRejected`, `ProgramTooLarge`.

        A program past the tenant's quota evicts that tenant's least recently used programs."""
        program_hash = hashlib.sha256(data).hexdigest()
        if len(data) > self.quota_bytes:
            raise ProgramTooLarge(f"the program is {len(data)} bytes, more than the store quota of "
                                  f"{self.quota_bytes} bytes per tenant (--max-store-mb)")
        if not self.exists(program_hash):
            self._compile(program_hash, data)
        with self._lock:
            if not self.path(program_hash).is_file():
                fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".part")
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, self.path(program_hash))  # atomic: a crash never leaves a torn program
                log.info("stored program %s (%d bytes)", program_hash, len(data))
            self._sizes[program_hash] = len(data)
            self._make_room(tenant, program_hash, len(data))
            self._own(tenant, program_hash)
        self.sweep()
        return program_hash

    def touch(self, tenant: str, program_hash: str) -> None:
        """`tenant` launches the program: it is in use (see `ttl_s`)."""
        now = self._clock()
        with self._lock:
            used = self._used.get(tenant)
            if used is None or program_hash not in used:
                return
            used[program_hash] = now
            if now - self._touched.get((tenant, program_hash), 0.0) >= _TOUCH_EVERY_S:
                self._touched[(tenant, program_hash)] = now
                marker = self._marker(tenant, program_hash)
                try:
                    os.utime(marker, (now, now))
                except FileNotFoundError:
                    log.warning("owner marker %s vanished; recreating it", marker)
                    self._own(tenant, program_hash)
        self.sweep()

    def sweep(self, force: bool = False) -> int:
        """Evict programs no tenant used for `ttl_s`; returns how many owner entries went."""
        now = self._clock()
        with self._lock:
            if not force and now - self._last_sweep < _SWEEP_EVERY_S:
                return 0
            self._last_sweep = now
            stale = [(t, h) for t, used in self._used.items() for h, at in used.items() if now - at > self.ttl_s]
            for tenant, program_hash in stale:
                log.info("evicting program %s of tenant %s: not launched for %.0f s", program_hash, tenant,
                         now - self._used[tenant][program_hash])
                self._disown(tenant, program_hash)
            return len(stale)

    def ensure_compiled(self, program_hash: str) -> None:
        """Make a stored program launchable in this host process. Raises KeyError if not stored."""
        if program_hash in self._compiled:
            return
        if not self.exists(program_hash):
            raise KeyError(program_hash)
        try:
            data = self.path(program_hash).read_bytes()
        except FileNotFoundError:  # evicted meanwhile
            raise KeyError(program_hash) from None
        self._compile(program_hash, data)

    # ---- internals (lock held where noted) ----
    def _marker(self, tenant: str, program_hash: str) -> Path:
        return self._owners / tenant / program_hash

    def _own(self, tenant: str, program_hash: str) -> None:  # lock held
        marker = self._marker(tenant, program_hash)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        now = self._clock()
        os.utime(marker, (now, now))
        self._used.setdefault(tenant, {})[program_hash] = now
        self._touched[(tenant, program_hash)] = now

    def _disown(self, tenant: str, program_hash: str) -> None:  # lock held
        used = self._used.get(tenant, {})
        used.pop(program_hash, None)
        self._touched.pop((tenant, program_hash), None)
        self._marker(tenant, program_hash).unlink(missing_ok=True)
        if not any(program_hash in u for u in self._used.values()):
            self._sizes.pop(program_hash, None)
            self.path(program_hash).unlink(missing_ok=True)
            log.info("deleted program %s: no tenant owns it any more", program_hash)

    def _make_room(self, tenant: str, program_hash: str, size: int) -> None:  # lock held
        used = self._used.get(tenant, {})
        if program_hash in used:
            return
        total = sum(self._sizes[h] for h in used)
        for old in sorted(used, key=used.__getitem__):
            if total + size <= self.quota_bytes:
                break
            log.info("evicting program %s of tenant %s: its store quota of %d bytes is full", old, tenant,
                     self.quota_bytes)
            total -= self._sizes.get(old, 0)
            self._disown(tenant, old)

    def _load(self) -> None:
        """Read the owner markers; delete stored files nobody owns (from before per-tenant stores)."""
        for marker in self._owners.glob("*/*") if self._owners.is_dir() else ():
            program_hash, tenant = marker.name, marker.parent.name
            path = self.path(program_hash)
            if _HASH_RE.fullmatch(program_hash) is None or not path.is_file():
                marker.unlink(missing_ok=True)
                continue
            self._sizes[program_hash] = path.stat().st_size
            self._used.setdefault(tenant, {})[program_hash] = marker.stat().st_mtime
        for path in self.root.glob("*.wasm"):
            if path.stem not in self._sizes:
                log.warning("deleting program %s: no tenant owns it (stored before per-tenant stores)", path.stem)
                path.unlink(missing_ok=True)

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
