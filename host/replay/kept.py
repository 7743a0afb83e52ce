"""A host's recordings: a `Recorder` for each launch made with `record`, and the files of the ended
ones, kept for `Host.recording` (the last `RECORDINGS_KEPT`, at most 4 x the bound of one).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from host.api import WIT_VERSION
from host.api import grammar as grammar_api
from host.events import InstanceEvent
from host.replay.recorder import Recorder

__all__ = ["RECORDINGS_KEPT", "Recordings"]

RECORDINGS_KEPT = 64  # recordings of ended instances kept

log = logging.getLogger(__name__)


class Recordings:
    """Recorders for one host's recorded launches and the recordings of those that ended."""

    def __init__(self, max_recording_bytes: int, model: str) -> None:
        self.max_recording_bytes = max_recording_bytes
        self.model = model
        self._kept: OrderedDict[str, tuple[str, bytes]] = OrderedDict()  # instance id -> (tenant, file)
        self._bytes = 0
        self._lock = threading.Lock()

    def recorder(self, program_hash: str, args: list[str], tenant: str) -> Recorder:
        """A recorder for a launch of `program_hash`, its file's header filled in."""
        return Recorder(self.max_recording_bytes, {
            "program": program_hash, "program_name": None, "arguments": list(args), "tenant": tenant,
            "wit_version": WIT_VERSION, "model": self.model, "recorded_at": time.time(),
            "resources": {"grammar.grammar": grammar_api.GRAMMAR_TYPE, "grammar.matcher": grammar_api.MATCHER_TYPE}})

    def listener(self, recorder: Recorder, tenant: str,
                 listener: Callable[[InstanceEvent], None]) -> Callable[[InstanceEvent], None]:
        """`listener`, after the recording is kept at the terminal event (so whoever sees the end finds it)."""
        def on_event(ev: InstanceEvent) -> None:
            if ev.terminal:
                try:
                    self.keep(ev.instance_id, tenant, recorder.finish(ev.event, ev.message))
                except Exception:  # (a host bug: the end still reaches the listener)
                    log.exception("the recording of instance %s could not be kept", ev.instance_id)
            listener(ev)

        return on_event

    def keep(self, instance_id: str, tenant: str, data: bytes) -> None:
        """Keep the last `RECORDINGS_KEPT` recordings, at most 4 x `max_recording_bytes` of them (the
        newest always)."""
        with self._lock:
            self._kept[instance_id] = (tenant, data)
            self._bytes += len(data)
            while len(self._kept) > 1 and (len(self._kept) > RECORDINGS_KEPT or
                                           self._bytes > 4 * self.max_recording_bytes):
                _iid, (_tenant, old) = self._kept.popitem(last=False)
                self._bytes -= len(old)

    def get(self, instance_id: str, tenant: str | None = None) -> bytes | None:
        """An ended instance's recording; None if unknown, forgotten or of another tenant than `tenant`
        (None: any)."""
        with self._lock:
            kept = self._kept.get(instance_id)
        if kept is None or (tenant is not None and kept[0] != tenant):
            return None
        return kept[1]
