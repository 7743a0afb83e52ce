"""The small persistent key-value store of inferlets (sqlite, one file per host data dir), one
namespace per tenant.

Each tenant (the client identity an instance acts for, `InstancePages.tenant`) has its own keys:
an instance sees, sets and lists only its tenant's, as with KV exports (the SDK keeps exported
contexts' token histories here). A tenant's keys and values take at most `max_bytes_per_tenant`
(UTF-8 bytes of keys plus values); a `set` past it raises `StoreFull`. A store file written before
tenants had namespaces is moved into tenant `local` (the embedded host's and a server without
tokens) when opened.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

__all__ = ["KeyValueStore", "StoreFull", "DEFAULT_KV_BYTES_PER_TENANT"]

DEFAULT_KV_BYTES_PER_TENANT = 64 * 2**20


class StoreFull(Exception):
    """A `set` that would take a tenant's keys and values past the store's limit."""


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class KeyValueStore:
    """Thread-safe (tenant, key) -> string map persisted in sqlite."""

    def __init__(self, path: Path | None, max_bytes_per_tenant: int = DEFAULT_KV_BYTES_PER_TENANT) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes_per_tenant = max_bytes_per_tenant
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS kv_tenant (tenant TEXT NOT NULL, key TEXT NOT NULL, "
                         "value TEXT NOT NULL, PRIMARY KEY (tenant, key))")
        old = self._db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'kv'").fetchone()
        if old is not None:  # the store before tenants: its keys were the embedded host's / tokenless server's
            self._db.execute("INSERT OR IGNORE INTO kv_tenant SELECT 'local', key, value FROM kv")
            self._db.execute("DROP TABLE kv")
        self._db.commit()
        self._lock = threading.Lock()
        self._used: dict[str, int] = {}  # tenant -> bytes of its keys and values (loaded on first use)

    def get(self, key: str, tenant: str = "local") -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv_tenant WHERE tenant = ? AND key = ?",
                                   (tenant, key)).fetchone()
        return None if row is None else row[0]

    def set(self, key: str, value: str, tenant: str = "local") -> None:
        """Store `value` under `key` for `tenant`; StoreFull past the tenant's limit (nothing changes)."""
        with self._lock:
            used = self._usage(tenant)
            row = self._db.execute("SELECT value FROM kv_tenant WHERE tenant = ? AND key = ?",
                                   (tenant, key)).fetchone()
            before = 0 if row is None else _size(key) + _size(row[0])
            after = used - before + _size(key) + _size(value)
            if after > self.max_bytes_per_tenant and after > used:
                raise StoreFull(f"the key-value store of tenant {tenant!r} holds {used} bytes; this set would "
                                f"take it to {after}, past its limit of {self.max_bytes_per_tenant} bytes")
            self._db.execute("INSERT OR REPLACE INTO kv_tenant (tenant, key, value) VALUES (?, ?, ?)",
                             (tenant, key, value))
            self._db.commit()
            self._used[tenant] = after

    def delete(self, key: str, tenant: str = "local") -> None:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv_tenant WHERE tenant = ? AND key = ?",
                                   (tenant, key)).fetchone()
            if row is None:
                return
            self._used[tenant] = self._usage(tenant) - _size(key) - _size(row[0])
            self._db.execute("DELETE FROM kv_tenant WHERE tenant = ? AND key = ?", (tenant, key))
            self._db.commit()

    def keys(self, tenant: str = "local") -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT key FROM kv_tenant WHERE tenant = ? ORDER BY key",
                                                   (tenant,))]

    def usage(self, tenant: str = "local") -> int:
        """UTF-8 bytes of `tenant`'s keys and values (what its limit counts)."""
        with self._lock:
            return self._usage(tenant)

    def _usage(self, tenant: str) -> int:  # lock held
        if tenant not in self._used:
            keys_values = self._db.execute("SELECT key, value FROM kv_tenant WHERE tenant = ?", (tenant,))
            self._used[tenant] = sum(_size(k) + _size(v) for k, v in keys_values)
        return self._used[tenant]

    def close(self) -> None:
        with self._lock:
            self._db.close()
