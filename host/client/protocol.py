"""Client protocol v1: message types, validation and msgpack encoding (shared by client and server).

Every frame is a binary WebSocket message holding one msgpack map with a ``"type"`` key.
`decode_request` turns a client frame into a typed request or raises `ProtocolError`; the
``encode_*`` helpers build server frames. See docs/protocol.md for the full specification.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from host.events import EVENT_KINDS, TERMINAL_EVENTS
from host.levels import PRIORITY_MAX, PRIORITY_MIN

__all__ = [
    "PROTOCOL_VERSION",
    "CHUNK_SIZE",
    "HASH_RE",
    "MAX_FRAME_BYTES",
    "EVENT_KINDS",
    "TERMINAL_EVENTS",
    "QUERY_SUBJECTS",
    "RECORDING_CHUNK",
    "ProtocolError",
    "Authenticate",
    "Ping",
    "Query",
    "UploadProgram",
    "LaunchInstance",
    "SignalInstance",
    "CloseInput",
    "TerminateInstance",
    "AttachInstance",
    "Request",
    "decode_request",
    "decode_server_message",
    "pack",
    "encode_response",
    "encode_event",
]

PROTOCOL_VERSION = 1
CHUNK_SIZE = 256 * 1024
# A full chunk plus the map around it fits easily; anything larger is refused by websockets itself.
MAX_FRAME_BYTES = 1024 * 1024
QUERY_SUBJECTS = ("program_exists", "models", "instances", "stats", "logs", "recording")
RECORDING_CHUNK = 512 * 1024  # bytes of a recording per `query recording` answer (well inside a frame)
HASH_RE = re.compile(r"[0-9a-f]{64}")  # a program hash: sha256 as 64 lowercase hex digits

# WebSocket close codes used when a frame carries no readable corr_id.
CLOSE_UNSUPPORTED = 1003  # text frame
CLOSE_INVALID_DATA = 1007  # not msgpack / not a map
CLOSE_POLICY = 1008  # a map we cannot answer (no corr_id)


class ProtocolError(Exception):
    """A client frame the server cannot act on.

    With `corr_id` set the server answers with a failed response; without one it closes the
    connection with `close_code` and `reason`.
    """

    def __init__(self, reason: str, corr_id: int | None = None, close_code: int = CLOSE_POLICY) -> None:
        super().__init__(reason)
        self.reason = reason
        self.corr_id = corr_id
        self.close_code = close_code


@dataclass(frozen=True)
class Authenticate:
    corr_id: int
    token: str


@dataclass(frozen=True)
class Ping:
    corr_id: int


@dataclass(frozen=True)
class Query:
    corr_id: int
    subject: str
    record: Any = None


@dataclass(frozen=True)
class UploadProgram:
    corr_id: int
    program_hash: str
    chunk_index: int
    total_chunks: int
    chunk_data: bytes


@dataclass(frozen=True)
class LaunchInstance:
    corr_id: int
    program_hash: str
    arguments: tuple[str, ...]
    detached: bool = False
    priority: int = 0  # host/levels.py: lower runs sooner
    record: bool = False  # record its host calls (host/replay/): `query recording` once it has ended


@dataclass(frozen=True)
class SignalInstance:
    instance_id: str
    message: str
    corr_id: int | None = None


@dataclass(frozen=True)
class CloseInput:
    """Extension of v1: the client will send no more signals; receive() returns none once drained."""

    corr_id: int
    instance_id: str


@dataclass(frozen=True)
class TerminateInstance:
    corr_id: int
    instance_id: str


@dataclass(frozen=True)
class AttachInstance:
    corr_id: int
    instance_id: str


Request = (
    Authenticate | Ping | Query | UploadProgram | LaunchInstance | SignalInstance | CloseInput | TerminateInstance
    | AttachInstance
)


@dataclass(frozen=True)
class _Field:
    name: str
    check: Callable[[Any], bool]
    expected: str
    required: bool = True


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_str_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) for x in v)


_CORR = _Field("corr_id", _is_int, "an integer")
_HASH = _Field("program_hash", lambda v: isinstance(v, str) and HASH_RE.fullmatch(v) is not None,
               "a sha256 digest as 64 lowercase hex digits")
_IID = _Field("instance_id", lambda v: isinstance(v, str), "a string")

_SCHEMAS: dict[str, tuple[type, tuple[_Field, ...]]] = {
    "authenticate": (Authenticate, (_CORR, _Field("token", lambda v: isinstance(v, str), "a string"))),
    "ping": (Ping, (_CORR,)),
    "query": (Query, (
        _CORR,
        _Field("subject", lambda v: v in QUERY_SUBJECTS, "one of " + ", ".join(QUERY_SUBJECTS)),
        _Field("record", lambda v: True, "any value", required=False),
    )),
    "upload_program": (UploadProgram, (
        _CORR,
        _HASH,
        _Field("chunk_index", lambda v: _is_int(v) and v >= 0, "a non-negative integer"),
        _Field("total_chunks", lambda v: _is_int(v) and v >= 1, "a positive integer"),
        _Field("chunk_data", lambda v: isinstance(v, bytes), "binary (msgpack bin)"),
    )),
    "launch_instance": (LaunchInstance, (
        _CORR,
        _HASH,
        _Field("arguments", _is_str_list, "a list of strings"),
        _Field("detached", lambda v: isinstance(v, bool), "a boolean", required=False),
        _Field("priority", lambda v: _is_int(v) and PRIORITY_MIN <= v <= PRIORITY_MAX,
               f"an integer from {PRIORITY_MIN} to {PRIORITY_MAX} (lower runs sooner)", required=False),
        _Field("record", lambda v: isinstance(v, bool), "a boolean", required=False),
    )),
    "signal_instance": (SignalInstance, (
        _Field("corr_id", _is_int, "an integer", required=False),
        _IID,
        _Field("message", lambda v: isinstance(v, str), "a string"),
    )),
    "close_input": (CloseInput, (_CORR, _IID)),
    "terminate_instance": (TerminateInstance, (_CORR, _IID)),
    "attach_instance": (AttachInstance, (_CORR, _IID)),
}


def decode_request(frame: bytes | str) -> Request:
    """Parse and validate one client frame.

    Raises:
        ProtocolError: naming what was wrong; with `corr_id` set when one could be read.
    """
    if isinstance(frame, str):
        raise ProtocolError("text frames are not supported: send one msgpack map per binary frame",
                            close_code=CLOSE_UNSUPPORTED)
    try:
        msg = msgpack.unpackb(frame, raw=False)
    except ValueError as exc:  # msgpack's FormatError/ExtraData/StackError and bad UTF-8 are ValueErrors
        raise ProtocolError(f"frame is not valid msgpack: {exc}", close_code=CLOSE_INVALID_DATA) from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {type(msg).__name__}",
                            close_code=CLOSE_INVALID_DATA)
    raw_corr = msg.get("corr_id")
    corr_id = raw_corr if _is_int(raw_corr) else None
    kind = msg.get("type")
    if kind not in _SCHEMAS:
        known = ", ".join(_SCHEMAS)
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {known}", corr_id)
    cls, fields = _SCHEMAS[kind]
    values: dict[str, Any] = {}
    for field in fields:
        if field.name not in msg:
            if field.required:
                raise ProtocolError(f"{kind}: missing field '{field.name}' ({field.expected})", corr_id)
            continue
        value = msg[field.name]
        if not field.check(value):
            shown = repr(value) if not isinstance(value, bytes | str) or len(value) < 80 else type(value).__name__
            raise ProtocolError(f"{kind}: field '{field.name}' must be {field.expected}, got {shown}", corr_id)
        values[field.name] = tuple(value) if field.name == "arguments" else value
    return cls(**values)


def decode_server_message(frame: bytes | str) -> dict[str, Any]:
    """Parse a server frame (used by the client); raises `ProtocolError` on anything malformed."""
    if isinstance(frame, str):
        raise ProtocolError("server sent a text frame")
    try:
        msg = msgpack.unpackb(frame, raw=False)
    except ValueError as exc:
        raise ProtocolError(f"server frame is not valid msgpack: {exc}") from exc
    if not isinstance(msg, dict) or msg.get("type") not in ("response", "instance_event"):
        raise ProtocolError(f"unexpected server frame: {msg!r:.200}")
    return msg


def pack(msg: Mapping[str, Any]) -> bytes:
    """Encode one message as a msgpack map (bytes as bin, str as str)."""
    return msgpack.packb(msg, use_bin_type=True)


def encode_response(corr_id: int | None, successful: bool, result: Any) -> bytes:
    return pack({"type": "response", "corr_id": corr_id, "successful": successful, "result": result})


def encode_event(instance_id: str, event: str, message: str, stream: str = "") -> bytes:
    msg = {"type": "instance_event", "instance_id": instance_id, "event": event, "message": message}
    if stream:  # (a `log` event's: log, stdout or stderr)
        msg["stream"] = stream
    return pack(msg)
