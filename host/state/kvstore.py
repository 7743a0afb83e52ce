"""The small persistent key-value store shared by inferlets (sqlite, one file per host data dir)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path


class KeyValueStore:
    """Thread-safe string -> string map persisted in sqlite."""

    def __init__(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(":memory:" if path is None else str(path), check_same_thread=False)
        self._db.execute("CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        self._db.commit()
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def set(self, key: str, value: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO kv (key, value) VALUES (?, ?)", (key, value))
            self._db.commit()

    def delete(self, key: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM kv WHERE key = ?", (key,))
            self._db.commit()

    def keys(self) -> list[str]:
        with self._lock:
            return [r[0] for r in self._db.execute("SELECT key FROM kv ORDER BY key")]

    def close(self) -> None:
        with self._lock:
            self._db.close()
