"""Which instance the calling thread runs: `calling.instance`, set while its guest runs.

The WIT imports read it through host/wasm/instance.py's `current()`; the call recorder
(host/replay/recorder.py) and a worker's remote instances (host/workers/remote.py) read or set it
here, so neither needs the instance module. A thread that runs no guest has none (None).
`calling.exception`: the Python exception a host function raised on this thread, for wasmtime-py's
`enter_wasm` to raise when the guest's call returns with it (host/api/fastcall.py).

A thread runs one instance after another (host/wasm/threads.py): `forget()` at an instance's end
clears both, so nothing of one instance is seen by the next on that thread.
"""

from __future__ import annotations

import threading

__all__ = ["calling", "forget"]

calling = threading.local()


def forget() -> None:
    """The calling thread's instance and pending exception, cleared (its instance has ended)."""
    calling.__dict__.clear()
