"""What both sides of an engine process share (gpu_backend/engine/client.py starts it,
server.py is the process): its `EngineSpec`, how its exit is told (`describe_exit`, `EngineDied`),
its idle poll.
"""

from __future__ import annotations

import json
import signal
from dataclasses import asdict, dataclass

__all__ = ["POLL_MS", "EngineDied", "EngineSpec", "describe_exit"]

POLL_MS = 1000  # the engine's idle poll (parent check, TP keep-alive)


class EngineDied(RuntimeError):
    """The engine process ended (crashed, killed) or could not be started."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process loads: the model and KV cache (as `load_backend`'s arguments), or the
    model-less stand-in (`standin=True`: gpu_backend/standin.py, for tests and host benchmarks).

    tp: tensor-parallel ranks of this engine; replica: which copy of the model this engine is (picks
    its GPUs: ranks of replica r use cuda:r*tp .. cuda:r*tp+tp-1); threads: torch CPU threads per
    rank (None: the CPU count shared among all ranks of all replicas, at least 1).
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None  # sizes the cache without kv_memory_bytes (gpu_backend/build.py)
    attention: str = "sdpa"
    tp: int = 1
    replicas: int = 1
    replica: int = 0
    threads: int | None = None
    standin: bool = False
    standin_delay_s: float = 0.0
    standin_vocab: int = 256

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> EngineSpec:
        return cls(**json.loads(s))


def describe_exit(rc: int | None) -> str:
    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit code {rc}"
