"""What crosses between the host and its instance workers (host/workers/): typed messages, and the
WIT values of one import call.

Each worker has one duplex connection (`multiprocessing.connection`, read and written in frames:
host/workers/frames.py) to the host. Messages are
msgpack, not pickle: the host decodes what a worker sends, and a worker runs guests, so nothing it
sends may make the host run code (a pickle can); a message is data of the types below or it is
refused (`WireError`). The values inside are what wasmtime-py gives an import and takes back:
ints, floats, strings, bytes, None and lists natively; tuples, records (a `Record`, or a
dataclass or object an import returns, crossing as its fields: a `Record` on the other side),
`Variant` and flags (sets) as msgpack extension types (a bytearray crosses as bytes). Resource handles belong to a
store and cannot leave their process: a guest's handle (`ResourceAny`) travels as its host
representation (the `rep` the host gave it), and a handle the host returns (`ResourceHost`) as
(rep, type, owned), made again on the worker's side. The host's `WorkerSpec` (the worker's
settings, from the host: trusted) is the only pickle, host to worker, once.

Host -> worker: `Launch` (start a guest), `Unpark` (a warm one was launched), `Reply` (an import's result, or the trap it raises),
`Stop` (trap a guest at its next epoch check), `Quit`. Worker -> host: `Call` (an import the
guest made), `Ended` (the guest's run is over: its end event as the worker classified it),
`Ready` (once, when the worker has started), `Recorded` (a recorded guest's calls, before its
`Ended`: host/replay/).
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any

import msgpack
from wasmtime.component import Record, ResourceAny, ResourceHost, Variant

__all__ = ["FROM_HOST", "FROM_WORKER", "Call", "Ended", "Launch", "Output", "Quit", "Ready", "Recorded", "Unpark",
           "RemoteHandle", "Reply", "Stop", "WireError", "dumps", "loads", "loads_value"]


class WireError(ValueError):
    """A message that is not one of ours, or a value that cannot cross."""


@dataclass(frozen=True)
class Launch:
    """Run a guest of `program` (compiled and cached on disk by the host) for instance `iid` with
    `args`; `warm`: started ahead of demand (it must reach its first host call within
    `Instance.WARM_DEADLINE_S` of CPU time, until `Unpark`; no arguments yet)."""

    iid: str
    program: str
    warm: bool = False
    args: tuple[str, ...] = ()
    record: int = 0  # record its host calls, up to this many bytes (host/replay/recorder.py); 0: not recorded


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
class Output:
    """A line of `iid`'s guest's stdout or stderr (its `log` event: kept and streamed by the host)."""

    iid: str
    stream: str
    text: str


@dataclass(frozen=True)
class Recorded:
    """A piece of `iid`'s recording, sent before its `Ended`: `calls` continues the calls encoded
    one after another (host/replay/recorder.py), `count` calls end in it, `truncated`: the recording
    stopped at its bound. (In pieces: one frame stays well under the host's frame limit.)"""

    iid: str
    calls: bytes
    count: int
    truncated: bool


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


_MESSAGES: tuple[type, ...] = (Launch, Unpark, Call, Reply, Stop, Ended, Ready, Quit, Output, Recorded)
_MESSAGE_CODE = {cls: 16 + i for i, cls in enumerate(_MESSAGES)}
_TUPLE, _RECORD, _VARIANT, _FLAGS, _HOST_HANDLE, _GUEST_HANDLE = range(1, 7)


_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in _MESSAGES}


class _Packers(threading.local):
    """Per thread: msgpack packers by nesting depth (an extension type's data is packed inside the
    outer pack, by the next one), and the store `dumps` resolves guest handles in. (A packer made
    per call cost ~6 us each, 40 us for a decode-step call.)"""

    def __init__(self) -> None:
        self.packers: list[msgpack.Packer] = []
        self.depth = 0
        self.store: Any = None


_packers = _Packers()


def _pack(obj: Any) -> bytes:
    p = _packers
    depth = p.depth
    if depth == len(p.packers):
        p.packers.append(msgpack.Packer(default=_default, use_bin_type=True, strict_types=True))
    p.depth = depth + 1
    try:
        return p.packers[depth].pack(obj)  # type: ignore[no-any-return]
    except BaseException:
        del p.packers[depth:]  # (its buffer may hold a part)
        raise
    finally:
        p.depth = depth


def _default(obj: Any) -> Any:
    ty = type(obj)
    code = _MESSAGE_CODE.get(ty)
    if code is not None:
        return msgpack.ExtType(code, _pack([getattr(obj, f) for f in _FIELDS[ty]]))
    if ty is tuple:
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if ty is Record:
        return msgpack.ExtType(_RECORD, _pack(obj.__dict__))
    return _other(obj)


def dumps(msg: Any, store: Any = None) -> bytes:
    """A message as bytes; `store`: the guest's store, to resolve its resource handles (worker side).
    Raises WireError for a value of a type that cannot cross."""
    _packers.store = store
    try:
        return _pack(msg)
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"cannot encode the message: {e}") from None
    finally:
        _packers.store = None


def _other(obj: Any) -> Any:
    """`dumps`'s encoding of the less common values (the common: messages, tuples, `Record`s)."""
    pack, store = _pack, _packers.store
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, pack(list(obj)))
    if isinstance(obj, Variant):
        return msgpack.ExtType(_VARIANT, pack([obj.tag, obj.payload]))
    if isinstance(obj, (set, frozenset)):
        return msgpack.ExtType(_FLAGS, pack(sorted(obj)))
    if isinstance(obj, (bytearray, memoryview)):
        return bytes(obj)
    if isinstance(obj, bool):  # (a bool subclass under strict types)
        return bool(obj)
    if isinstance(obj, RemoteHandle):
        return msgpack.ExtType(_GUEST_HANDLE, pack(obj.remote_rep))
    if isinstance(obj, ResourceAny):  # a guest's handle (worker side): its rep in this store
        return msgpack.ExtType(_GUEST_HANDLE, pack(obj.to_host(store).rep))
    if isinstance(obj, ResourceHost):  # a handle the host made (host side)
        return msgpack.ExtType(_HOST_HANDLE, pack([obj.rep, obj.type, obj.owned]))
    if isinstance(obj, int):  # (an int subclass: an IntEnum; numpy's are not)
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, str):
        return str(obj)
    if isinstance(obj, list):
        return list(obj)
    if isinstance(obj, dict):
        return dict(obj)
    if hasattr(obj, "item") and hasattr(obj, "dtype"):  # a numpy scalar or array
        return obj.tolist() if getattr(obj, "ndim", 0) else obj.item()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return msgpack.ExtType(_RECORD, pack({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}))
    if isinstance(obj, Record) or hasattr(obj, "__dict__"):
        return msgpack.ExtType(_RECORD, pack(dict(vars(obj))))
    raise WireError(f"a value of type {type(obj).__name__} cannot cross to or from a worker")


def _record(fields: dict[str, Any]) -> Record:
    rec = Record()
    for k, v in fields.items():
        if not isinstance(k, str):
            raise WireError("a record's field names must be strings")
        rec.__dict__[k] = v
    return rec


_STR_OR_NONE = (str, type(None))
# What each side takes from the other, and the types of each message's fields: a worker's bytes are
# not trusted (the host would route a `Call` with a list for an id into a dict lookup, and fail).
FROM_WORKER: dict[type, tuple[Any, ...]] = {Call: (str, str, tuple, bool), Ended: (str, str, str), Ready: (int,),
                                            Output: (str, str, str), Recorded: (str, bytes, int, bool)}
FROM_HOST: dict[type, tuple[Any, ...]] = {Launch: (str, str, bool, tuple, int), Unpark: (str, tuple),
                                          Reply: (str, object, _STR_OR_NONE), Stop: (str, str), Quit: ()}


def _unpacker(from_worker: bool) -> Any:
    """The msgpack decoder of one side's messages (made once per side: `loads`)."""

    def ext(code: int, data: bytes) -> Any:
        value = unpack(data)
        if code == _TUPLE:
            return tuple(value)
        if code == _RECORD:
            if not isinstance(value, dict):
                raise WireError("a record must be a map")
            return _record(value)
        if code == _VARIANT:
            tag, payload = value
            return Variant(tag, payload)
        if code == _FLAGS:
            return set(value)
        if code == _GUEST_HANDLE:
            if not isinstance(value, int):
                raise WireError("a handle's rep must be an int")
            return RemoteHandle(value)
        if code == _HOST_HANDLE:
            if from_worker:
                raise WireError("a worker cannot send a host's resource handle")
            rep, ty, owned = value
            if not (isinstance(rep, int) and isinstance(ty, int)):
                raise WireError("a host handle is (rep, type, owned)")
            return ResourceHost.own(rep, ty) if owned else ResourceHost.borrow(rep, ty)
        if 16 <= code < 16 + len(_MESSAGES):
            return _MESSAGES[code - 16](*value)
        raise WireError(f"unknown extension type {code}")

    def unpack(data: bytes) -> Any:
        return msgpack.unpackb(data, ext_hook=ext, raw=False, strict_map_key=True, use_list=True)

    return unpack


_unpackers: dict[int, Any] = {}


def loads(data: bytes, accept: dict[type, tuple[Any, ...]] = FROM_WORKER) -> Any:
    """A message from bytes, one of the kinds in `accept` with fields of its types; WireError if
    not. From a worker (the default), a host's resource handle is refused too: only the host
    makes those."""
    unpack = _unpackers.get(id(accept))
    if unpack is None:
        unpack = _unpackers[id(accept)] = _unpacker(accept is FROM_WORKER)
    try:
        msg = unpack(data)
    except WireError:
        raise
    except Exception as e:  # malformed bytes, a wrong arity, a bad tag
        raise WireError(f"malformed message: {type(e).__name__}: {e}") from None
    types = accept.get(type(msg))
    if types is None:
        raise WireError(f"not a message this side takes: {type(msg).__name__}")
    for name, want in zip(_FIELDS[type(msg)], types, strict=True):
        if not isinstance(getattr(msg, name), want):
            raise WireError(f"{type(msg).__name__}.{name} has the wrong type")
    return msg


def loads_value(data: bytes) -> Any:
    """A value `dumps` encoded, as the host decodes it (a recording: host/replay/); WireError if malformed."""
    unpack = _unpackers.get(0)
    if unpack is None:
        unpack = _unpackers[0] = _unpacker(False)
    try:
        return unpack(data)
    except WireError:
        raise
    except Exception as e:  # malformed bytes, a wrong arity, a bad tag
        raise WireError(f"malformed value: {type(e).__name__}: {e}") from None
