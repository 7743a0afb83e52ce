"""An instance's log: the last lines of its `runtime.log`, stdout and stderr, kept and streamed.

Each line goes into a bounded ring (the last `MAX_LINES` lines, at most `MAX_BYTES` of text; a line
longer than `MAX_LINE` is cut) that the host keeps after the instance ends (`Host.logs`, the
protocol's `logs` query, the dashboard), and is streamed to the instance's client as a `log` event,
until `MAX_STREAMED` bytes were streamed (then one note says the rest is only in the ring): a guest
printing in a loop fills its ring, not its client's connection. WASI output arrives in pieces; a
piece without a newline waits for the rest of its line (or the instance's end).
"""

from __future__ import annotations

import threading
import time
from collections import deque

__all__ = ["InstanceLog"]

MAX_LINES = 1000
MAX_BYTES = 256 * 1024
MAX_LINE = 8 * 1024
MAX_STREAMED = 1 << 20


class InstanceLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: deque[tuple[float, str, str]] = deque()
        self._bytes = 0
        self._streamed = 0
        self.dropped = 0  # lines pushed out of the ring
        self._partial: dict[str, bytearray] = {}

    def add(self, stream: str, text: str) -> str | None:
        """Keep one line; returns what to stream to the client (None: past the streamed bound)."""
        if len(text) > MAX_LINE:
            text = text[:MAX_LINE] + " [cut]"
        with self._lock:
            self._lines.append((time.time(), stream, text))
            self._bytes += len(text)
            while len(self._lines) > MAX_LINES or self._bytes > MAX_BYTES:
                self._bytes -= len(self._lines.popleft()[2])
                self.dropped += 1
            if self._streamed > MAX_STREAMED:
                return None
            self._streamed += len(text)
            if self._streamed > MAX_STREAMED:
                return (f"[the instance's log passed {MAX_STREAMED} bytes: later lines are kept in its last "
                        f"{MAX_LINES} only (the `logs` query)]")
            return text

    def write(self, stream: str, data: bytes) -> list[str]:
        """A piece of WASI output: the whole lines it completes."""
        with self._lock:
            buf = self._partial.setdefault(stream, bytearray())
            buf += data
            *lines, rest = [bytes(b) for b in buf.split(b"\n")]
            if len(rest) > MAX_LINE:  # a line with no end in sight: kept as it is
                lines.append(rest)
                rest = b""
            self._partial[stream] = bytearray(rest)
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]

    def flush(self) -> list[tuple[str, str]]:
        """The unfinished lines (at the instance's end), as (stream, text)."""
        with self._lock:
            out = [(s, b.decode("utf-8", "replace")) for s, b in self._partial.items() if b]
            self._partial.clear()
        return out

    def __len__(self) -> int:
        """Lines in the ring now."""
        return len(self._lines)

    def entries(self) -> list[dict[str, object]]:
        """The ring, oldest first: {"t": unix time, "stream", "text"}."""
        with self._lock:
            return [{"t": t, "stream": s, "text": x} for t, s, x in self._lines]
