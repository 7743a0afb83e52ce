"""The frames of a worker's connection: multiprocessing.connection's framing (a 4-byte big-endian
signed length, then the bytes), read many at a time (`Frames`) and written many in one system call
(`send_frames`). What the bytes mean is host/workers/wire.py's.
"""

from __future__ import annotations

import os
import struct

from host.workers.wire import WireError

__all__ = ["Frames", "send_frames"]

_HEADER = struct.Struct("!i")


class Frames:
    """The frames arriving on a connection's file descriptor, as many as one read brings: a burst
    of messages (a step's answers) costs one read instead of `Connection.recv_bytes`' two each.
    Reads only: it must be the descriptor's only reader. The frames are those `send_bytes` and
    `send_frames` write."""

    def __init__(self, fd: int, max_frame: int = 0x7FFFFFFF) -> None:
        self.fd = fd
        self.max_frame = max_frame  # a longer frame is refused (WireError) before it is read
        self._buf = bytearray()

    def read(self) -> list[bytes]:
        """The next frames (at least one; blocks until then); EOFError when the other side is gone."""
        buf = self._buf
        while True:
            frames, used, want = [], 0, _HEADER.size
            while len(buf) - used >= _HEADER.size:
                (n,) = _HEADER.unpack_from(buf, used)
                if n < 0:  # (multiprocessing's 8-byte length of a frame over 2 GiB: never ours)
                    raise WireError("a frame over 2 GiB")
                if n > self.max_frame:
                    raise WireError(f"a frame of {n} bytes, over the {self.max_frame} allowed")
                if len(buf) - used - _HEADER.size < n:
                    want = n + _HEADER.size
                    break
                frames.append(bytes(buf[used + _HEADER.size:used + _HEADER.size + n]))
                used += _HEADER.size + n
            if used:
                del buf[:used]
            if frames:
                return frames
            # (a long frame in reads of at most 1 MiB: its length alone allocates nothing)
            chunk = os.read(self.fd, min(max(want - len(buf), 1 << 16), 1 << 20))
            if not chunk:
                raise EOFError
            buf += chunk


def send_frames(fd: int, datas: list[bytes]) -> None:
    """Write `datas` as frames in one write (a step's answers: one system call, one wake-up on the
    other side). The caller holds the connection's send lock."""
    out = bytearray()
    for d in datas:
        if len(d) > 0x7FFFFFFF:
            raise WireError("a message over 2 GiB")
        out += _HEADER.pack(len(d))
        out += d
    view = memoryview(out)
    while view:
        view = view[os.write(fd, view):]
