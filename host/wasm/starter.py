"""Cold starts off the launching thread.

`Thread.start` returns only once the new thread has run its first bytecode, and in a burst that
thread waits for the GIL behind every running instance: a launch that found no parked instance
(host/wasm/warm.py) took ~1 ms of the launching thread's time, 3.6 ms median and up to 24 ms in a
first burst of 128 (pie-serve launches on its asyncio loop, so every other client's messages and
streamed tokens waited that long; bench/HISTORY.md). `Starter` starts those instances'
threads on one worker thread of its own (a `ThreadPoolExecutor`'s, started on first use), in launch
order; `Host.launch` returns as soon as the instance is queued for it.

Invariants: instances start in the order they were queued; a queued instance that was terminated
meanwhile still starts (it ends at once, with its event, as a cold start would), also after
`close`; `Instance.join` waits for a queued instance to be started first.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from host.wasm.instance import Instance

__all__ = ["Starter"]

log = logging.getLogger(__name__)


class Starter:
    """Starts queued instances' threads, in order, on one worker thread."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pie-starter")

    def start_soon(self, inst: Instance) -> None:
        """Queue `inst` to have its thread started (cheap: no wait for the GIL or the new thread)."""
        self._pool.submit(_start, inst)

    def close(self) -> None:
        """No more starts are queued; those queued still run, then the worker thread ends."""
        self._pool.shutdown(wait=False)


def _start(inst: Instance) -> None:
    try:
        inst.start()
    except Exception as e:  # (no thread left in the process): this instance ends, the host goes on
        log.exception("could not start %s", inst.label)
        inst.fail_to_start(f"host error: could not start the instance's thread: {e}")
