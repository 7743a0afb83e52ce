"""Which instance the calling thread runs: `calling.instance`, set while its guest runs.

The WIT imports read it through host/wasm/instance.py's `current()`; the call recorder
(host/replay/recorder.py) and a worker's remote instances (host/workers/remote.py) read or set it
here, so neither needs the instance module. A thread that runs no guest has none (None).
"""

from __future__ import annotations

import threading

__all__ = ["calling"]

calling = threading.local()
