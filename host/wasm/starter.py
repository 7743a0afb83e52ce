"""Cold starts off the launching thread.

`Thread.start` returns only once the new thread has run its first bytecode, and in a burst that
thread waits for the GIL behind every running instance: a launch that found no parked instance
(host/wasm/warm.py) took ~1 ms of the launching thread's time, 3.6 ms median and up to 24 ms in a
first burst of 128 (pie-serve launches on its asyncio loop, so every other client's messages and
streamed tokens waited that long). `Starter` starts those instances' threads on a thread of its
own, in launch order; `Host.launch` returns as soon as the instance is queued for it.

Invariants: instances start in the order they were queued; a queued instance that was terminated
meanwhile still starts (it ends at once, with its event, as a cold start would); `Instance.join`
waits for a queued instance to be started first. The thread is made on first use and ends after
`_IDLE_S` with nothing queued (a process that makes many hosts keeps no idle threads).
"""

from __future__ import annotations

import logging
import queue
import threading

from host.wasm.instance import Instance

__all__ = ["Starter"]

log = logging.getLogger(__name__)

_IDLE_S = 1.0


class Starter:
    """Starts queued instances' threads, in order, on one thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Instance] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start_soon(self, inst: Instance) -> None:
        """Queue `inst` to have its thread started (cheap: no wait for the GIL or the new thread,
        except the first time after an idle second, when the starter's own thread is made)."""
        self._queue.put(inst)
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pie-starter", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                inst = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:  # idle: the thread ends (the next start_soon makes another)
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                inst.start()
            except Exception as e:  # (no thread left in the process): this instance ends, the host goes on
                log.exception("could not start %s", inst.label)
                inst.fail_to_start(f"host error: could not start the instance's thread: {e}")
