"""The messages between the host and its instance workers (host/workers/wire.py): msgpack, every
value kind an import takes or returns round-trips, and bytes that are not one of our messages
(a pickle above all: it could make the host run code) are refused without being run."""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
from wasmtime.component import Record, ResourceHost, Variant

from gpu_backend.types import OutputResult
from host.workers import wire
from host.workers.frames import Frames, send_frames


def _record(**fields: object) -> Record:
    r = Record()
    r.__dict__.update(fields)
    return r


def test_messages_and_values_round_trip() -> None:
    sampler = _record(temperature=0.5, top_k=0, top_p=1.0, min_p=0.0, seed=None)
    call = wire.loads(wire.dumps(wire.Call("i1", "forward.decode-step", ([3, 4], 2, 77, 9, sampler), oneway=True)))
    assert isinstance(call, wire.Call) and (call.iid, call.name, call.oneway) == ("i1", "forward.decode-step", True)
    assert call.args[:4] == ([3, 4], 2, 77, 9) and isinstance(call.args, tuple)
    assert isinstance(call.args[4], Record) and vars(call.args[4]) == vars(sampler)
    value = (7, Variant("err", "bad"), {"a", "b"}, bytearray(b"\x00\xff"), True, None, 1.5, "é", b"raw")
    reply = wire.loads(wire.dumps(wire.Reply("i2", value)), wire.FROM_HOST)
    assert reply.value == (7, Variant("err", "bad"), {"a", "b"}, b"\x00\xff", True, None, 1.5, "é", b"raw")
    # a dataclass an import returns (forward.wait's OutputResult) crosses as a record of its fields
    out = wire.loads(wire.dumps(wire.Reply("i3", [OutputResult(token=5, ids=[1, 2], probs=[0.5, 0.25])])),
                     wire.FROM_HOST)
    assert vars(out.value[0]) == {"token": 5, "ids": [1, 2], "probs": [0.5, 0.25], "logprob": None, "hidden": None}
    handle = wire.loads(wire.dumps(wire.Reply("i4", ResourceHost.own(3, 9))), wire.FROM_HOST).value
    assert isinstance(handle, ResourceHost) and (handle.rep, handle.type, handle.owned) == (3, 9, True)
    guest = wire.loads(wire.dumps(wire.Call("i5", "$drop.grammar.matcher", (wire.RemoteHandle(12),)))).args[0]
    assert isinstance(guest, wire.RemoteHandle) and guest.remote_rep == 12
    for msg in (wire.Launch("i6", "prog", True, ("--a", "b")), wire.Unpark("i6", ("x",)), wire.Stop("i6", "why"),
                wire.Quit(), wire.Launch("i7", "prog", False, (), record=1024)):
        assert wire.loads(wire.dumps(msg), wire.FROM_HOST) == msg
    for msg in (wire.Ended("i6", "completed", "done"), wire.Ready(3), wire.Recorded("i7", b"\x94\xa1x", 1, False)):
        assert wire.loads(wire.dumps(msg)) == msg


def test_a_pickle_or_garbage_from_a_worker_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    @dataclass
    class Evil:
        def __reduce__(self) -> tuple[object, ...]:
            return (Path.touch, (marker,))

    for data in (pickle.dumps(Evil()), pickle.dumps(wire.Ended("i", "completed", "x")), b"", b"\xc1",
                 msgpack.packb([1, 2]), msgpack.packb({"iid": "x"}),
                 msgpack.packb(msgpack.ExtType(99, msgpack.packb([]))),
                 msgpack.packb(msgpack.ExtType(16 + 3, msgpack.packb(["too", "many", "fields", 1, 2])))):
        with pytest.raises(wire.WireError):
            wire.loads(data)
    assert not marker.exists()


def test_a_worker_sends_only_its_own_kinds_with_fields_of_their_types() -> None:
    """From a worker: Call, Ended, Ready; an id that is not a string (the host looks it up in a
    dict), a host's resource handle (only the host makes those) or a host's message is refused."""
    for msg in (wire.Call(["not", "a", "str"], "kv.release", ()),  # type: ignore[arg-type]
                wire.Call("i", "kv.release", [1, 2]),  # type: ignore[arg-type]
                wire.Ended("i", "completed", 5),  # type: ignore[arg-type]
                wire.Reply("i", ResourceHost.own(1, 2)), wire.Launch("i", "p"), wire.Stop("i", "x"),
                wire.Call("i", "x", (ResourceHost.own(1, 2),))):
        with pytest.raises(wire.WireError):
            wire.loads(wire.dumps(msg))
    with pytest.raises(wire.WireError):  # and the host's kinds only, the other way
        wire.loads(wire.dumps(wire.Call("i", "x", ())), wire.FROM_HOST)


def test_a_value_that_cannot_cross_is_an_error_not_a_crash() -> None:
    class Opaque:
        __slots__ = ("x",)

    with pytest.raises(wire.WireError, match="Opaque"):
        wire.dumps(wire.Reply("i", [Opaque()]))
    # the encoder is usable after a failure (its packers are per thread and depth)
    assert wire.loads(wire.dumps(wire.Reply("i", (1, [2]))), wire.FROM_HOST).value == (1, [2])


def test_frames_come_as_one_read_brings_them_split_or_whole_and_interoperate_with_connection() -> None:
    """`wire.Frames` reads multiprocessing.connection's framing: several frames from one write, a
    frame split across writes, a frame larger than one read, frames from `Connection.send_bytes`;
    `send_frames` writes frames `Connection.recv_bytes` reads; the other side gone is EOFError."""
    import os
    import threading
    from multiprocessing import Pipe

    ours, theirs = Pipe(duplex=True)
    frames = Frames(ours.fileno())
    send_frames(theirs.fileno(), [b"a", b"", b"ccc"])
    assert frames.read() == [b"a", b"", b"ccc"]
    whole = b"\x00\x00\x00\x05hello"
    os.write(theirs.fileno(), whole[:6])
    got: list[list[bytes]] = []
    reader = threading.Thread(target=lambda: got.append(frames.read()))
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # half a frame is not a frame
    os.write(theirs.fileno(), whole[6:])
    reader.join(5)
    assert got == [[b"hello"]]
    big = bytes(range(256)) * 8192  # 2 MiB: many reads
    writer = threading.Thread(target=theirs.send_bytes, args=(big,))
    writer.start()
    assert frames.read() == [big]
    writer.join(5)
    send_frames(ours.fileno(), [b"x", b"yz"])
    assert theirs.recv_bytes() == b"x" and theirs.recv_bytes() == b"yz"
    theirs.close()
    with pytest.raises(EOFError):
        frames.read()
    ours.close()


def test_a_frame_longer_than_allowed_is_refused_before_it_is_read() -> None:
    """A worker announcing a frame past `max_frame` (the host's: twice the guest memory cap) gets a
    WireError at its header, without the host allocating or waiting for the announced bytes."""
    import os
    from multiprocessing import Pipe

    ours, theirs = Pipe(duplex=True)
    frames = Frames(ours.fileno(), max_frame=1000)
    os.write(theirs.fileno(), (0x7FFFFFF0).to_bytes(4, "big"))
    with pytest.raises(wire.WireError, match="over the 1000 allowed"):
        frames.read()
    ours.close()
    theirs.close()
