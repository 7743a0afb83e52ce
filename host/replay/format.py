"""The recording file: what `pie-run --record` writes and `pie-replay` reads (docs/observability.md).

One msgpack map, its values in the codec of the host's worker messages (host/workers/wire.py:
tuples, records, variants, flags and resource handles as extension types):

    {"format": "pie-recording", "version": 1,
     "program": sha256 hex of the .wasm, "program_name": a standard inferlet's name or None,
     "arguments": [str], "tenant": str, "wit_version": the host's newest, "model": the model's name,
     "resources": {"grammar.grammar": host type id, ...}, "recorded_at": unix time,
     "calls": [[name, args, ok, value], ...], "end": {"event": str, "message": str}, "truncated": bool}

`name` is "interface.function" (e.g. "forward.generate-fresh"); `value` is what the host returned,
or, when `ok` is false, the text of the trap the call raised. A guest's resource handle in `args`
is its rep (the host's id of it); a handle the host returned is (rep, type id, owned).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

__all__ = ["FORMAT", "VERSION", "Call", "Recording", "RecordingError", "encode", "load", "named", "save"]

FORMAT = "pie-recording"
VERSION = 1

_packer = msgpack.Packer(use_bin_type=True)


class RecordingError(ValueError):
    """The bytes are not a recording this version reads: the message says why."""


@dataclass(frozen=True)
class Call:
    """One host call: its name, its arguments, and what it gave back (`value`) or the trap it raised
    (`ok` false: `value` is the trap's text)."""

    name: str
    args: list[Any]
    ok: bool
    value: Any


@dataclass(frozen=True)
class Recording:
    """A recording as read back: the instance's program and arguments, its calls in order, its end."""

    program: str
    calls: list[Call]
    end: tuple[str, str] | None  # (event, message); None: the recording did not say
    truncated: bool = False  # it stopped growing at its bound: calls after these were not kept
    arguments: list[str] = field(default_factory=list)
    program_name: str | None = None
    tenant: str = ""
    wit_version: str = ""
    model: str = ""
    resources: dict[str, int] = field(default_factory=dict)


def encode(header: dict[str, Any], calls: bytes, count: int, end: tuple[str, str], truncated: bool) -> bytes:
    """The file for `count` calls already encoded one after another (`calls`, as `Recorder` keeps
    them) under `header` (program, arguments, ...; see the module docstring)."""
    # (imported here, not above: `named` serves pie-run --server, which imports no wasmtime)
    from host.workers import wire

    fields = {"format": FORMAT, "version": VERSION, **header}
    parts = [_packer.pack_map_header(len(fields) + 3)]
    for key, value in fields.items():
        parts += [wire.dumps(key), wire.dumps(value)]
    parts += [wire.dumps("calls"), _packer.pack_array_header(count), calls,
              wire.dumps("end"), wire.dumps({"event": end[0], "message": end[1]}),
              wire.dumps("truncated"), wire.dumps(bool(truncated))]
    return b"".join(parts)


def load(data: bytes) -> Recording:
    """Read a recording; RecordingError naming what is wrong with anything else."""
    from host.workers import wire

    if not data:
        raise RecordingError("the file is empty")
    try:
        doc = wire.loads_value(bytes(data))
    except wire.WireError as e:
        raise RecordingError(f"not a pie recording: the bytes do not decode ({_why(e)})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecordingError(f"not a pie recording: no \"format\": \"{FORMAT}\" in it")
    version = doc.get("version")
    if version != VERSION:
        raise RecordingError(f"recording format version {version!r} is not one this pie-replay reads "
                             f"(it reads version {VERSION})")
    program = doc.get("program")
    if not isinstance(program, str):
        raise RecordingError("the recording names no program (\"program\": its sha256)")
    raw_calls = doc.get("calls")
    if not isinstance(raw_calls, list):
        raise RecordingError("the recording has no list of calls")
    calls = []
    for i, c in enumerate(raw_calls):
        if not (isinstance(c, list) and len(c) == 4 and isinstance(c[0], str) and isinstance(c[1], list)
                and isinstance(c[2], bool) and (c[2] or isinstance(c[3], str))):
            raise RecordingError(f"call {i} of the recording is not [name, args, ok, value]")
        calls.append(Call(c[0], c[1], c[2], c[3]))
    end = doc.get("end")
    end_pair = None
    if isinstance(end, dict) and isinstance(end.get("event"), str) and isinstance(end.get("message"), str):
        end_pair = (end["event"], end["message"])
    resources = doc.get("resources")
    arguments = doc.get("arguments")
    return Recording(
        program=program, calls=calls, end=end_pair, truncated=bool(doc.get("truncated")),
        arguments=[a for a in arguments if isinstance(a, str)] if isinstance(arguments, list) else [],
        program_name=doc.get("program_name") if isinstance(doc.get("program_name"), str) else None,
        tenant=_str(doc.get("tenant")), wit_version=_str(doc.get("wit_version")), model=_str(doc.get("model")),
        resources={k: v for k, v in resources.items() if isinstance(k, str) and isinstance(v, int)}
        if isinstance(resources, dict) else {})


def named(data: bytes, program_name: str) -> bytes:
    """The recording with its `program_name` set (pie-run knows the standard inferlet it ran; the
    host does not). Its values are left as they are (extension types untouched): no wasmtime needed."""
    doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecordingError("not a pie recording")
    doc["program_name"] = program_name
    return bytes(msgpack.packb(doc, use_bin_type=True))


def save(path: Path, data: bytes, program_name: str | None = None) -> str:
    """Write a recording to `path` (its `program_name` set, when given); the line pie-run prints."""
    try:
        if program_name:
            data = named(data, program_name)
        path.write_bytes(data)
    except (OSError, ValueError) as e:
        return f"pie-run: cannot write the recording to {path}: {e}"
    return f"pie-run: recorded the inferlet's host calls in {path} ({len(data)} bytes); replay: pie-replay {path}"


def _str(v: Any) -> str:
    return v if isinstance(v, str) else ""


def _why(e: Exception) -> str:
    text = str(e)
    if "incomplete input" in text or "Insufficient data" in text:
        return "it ends too soon: the file is cut short"
    if "ExtraData" in text:
        return "it has more after its end: not one msgpack value"
    return text
