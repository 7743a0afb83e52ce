"""What crosses between the host and its instance workers (host/workers/): typed messages, and the
WIT values of one import call.

Each worker has one duplex connection (`multiprocessing.connection`) to the host. Messages are
pickled dataclasses; the values inside are what wasmtime-py gives an import and takes back
(ints, floats, strings, bytes, lists, tuples, `Record`, `Variant`, None), except resource handles,
which belong to a store and cannot leave their process: a guest's handle (`ResourceAny`) travels
as its host representation (the `rep` the host gave it), and a handle the host returns
(`ResourceHost`) as (rep, type, owned), made again on the worker's side.

Host -> worker: `Launch` (start a guest), `Unpark` (a warm one was launched), `Reply` (an import's result, or the trap it raises),
`Stop` (trap a guest at its next epoch check), `Quit`. Worker -> host: `Call` (an import the
guest made), `Ended` (the guest's run is over: its end event as the worker classified it),
`Ready` (once, when the worker has started).
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any

from wasmtime.component import ResourceAny, ResourceHost

__all__ = ["Call", "Ended", "Launch", "Quit", "Ready", "Unpark", "RemoteHandle", "Reply", "Stop", "dumps", "loads"]


@dataclass(frozen=True)
class Launch:
    """Run a guest of `program` (compiled and cached on disk by the host) for instance `iid` with
    `args`; `warm`: started ahead of demand (it must reach its first host call within
    `Instance.WARM_DEADLINE_S` of CPU time, until `Unpark`; no arguments yet)."""

    iid: str
    program: str
    warm: bool = False
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Unpark:
    """The host launched warm instance `iid` with `args`: it serves a client from now on."""

    iid: str
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class Call:
    """The guest of `iid` called import `name` (e.g. "forward.generate") with `args`; `oneway`: the
    guest does not wait for it (no `Reply`; a failure traps the guest at its next call)."""

    iid: str
    name: str
    args: tuple[Any, ...]
    oneway: bool = False


@dataclass(frozen=True)
class Reply:
    """The result of `iid`'s pending call, or `trap`: the message the guest traps with."""

    iid: str
    value: Any = None
    trap: str | None = None


@dataclass(frozen=True)
class Stop:
    """Trap `iid`'s guest at its next epoch check (the host terminated it)."""

    iid: str
    reason: str


@dataclass(frozen=True)
class Ended:
    """`iid`'s guest has ended: `event` and `message` as the worker classified its end (a completed
    guest's message is its return value, set by `runtime.set-return` in the worker)."""

    iid: str
    event: str
    message: str


@dataclass(frozen=True)
class Ready:
    """The worker has its engine and linker: it takes launches from now on."""

    index: int


@dataclass(frozen=True)
class Quit:
    """The worker ends (the host shuts down)."""


class RemoteHandle(ResourceAny):
    """A guest's resource handle on the host's side: only its `rep` crossed (resolved by the
    worker in the guest's store); `to_host` gives it back as the host's imports ask for it."""

    def __init__(self, rep: int) -> None:  # (not ResourceAny's: there is no store here)
        self.remote_rep = rep

    def to_host(self, store: Any) -> Any:
        return _Rep(self.remote_rep)

    def close(self) -> None:
        pass

    def __del__(self) -> None:
        pass


@dataclass(frozen=True)
class _Rep:
    rep: int


class _Pickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, store: Any) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._store = store

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, RemoteHandle):
            return ("any", obj.remote_rep)
        if isinstance(obj, ResourceAny):  # a guest's handle (worker side): its rep in this store
            return ("any", obj.to_host(self._store).rep)
        if isinstance(obj, ResourceHost):  # a handle the host made (host side)
            return ("host", obj.rep, obj.type, obj.owned)
        return None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "any":
            return RemoteHandle(pid[1])
        if kind == "host":
            _kind, rep, ty, owned = pid
            return ResourceHost.own(rep, ty) if owned else ResourceHost.borrow(rep, ty)
        raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")


def dumps(msg: Any, store: Any = None) -> bytes:
    """A message as bytes; `store`: the guest's store, to resolve its resource handles (worker side)."""
    buf = io.BytesIO()
    _Pickler(buf, store).dump(msg)
    return buf.getvalue()


def loads(data: bytes) -> Any:
    return _Unpickler(io.BytesIO(data)).load()
