"""Replaying a recording: the guest runs again against its recorded host calls, with no model and
no scheduler, and must make the same calls in the same order.

The linker defines every `pie:inferlet` function the component imports (its own list: a guest
importing what the recording's host did not serve fails the same way) as a function that takes
the next recorded call, checks the guest's call against it (the name, then each argument, compared
in the recording's encoding) and gives back the recorded result, or raises the recorded trap.
Resources (grammar, matcher) are host resources with the recorded type ids, as the host defines
them. `wasi:clocks/monotonic-clock`, which the host provides (host/api/wasi.py), is served from the
recording as well: `now` gives back the recorded times, and a subscription, once matched, a pollable
that is ready at once (a replay does not wait). The rest of WASI is wasmtime's own: the wall clock
and randomness are the replay's, not the recording's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import wasmtime
from wasmtime import Store, WasiConfig
from wasmtime.component import Component, ComponentInstanceType, FuncType, Linker, ResourceType

from host.api.fastcall import add_func
from host.api.wasi import CLOCK_FUNCS, CLOCK_INTERFACE, ReadyPollables
from host.replay.format import Call, Recording
from host.workers import wire

__all__ = ["PACKAGE", "Divergence", "Outcome", "replay"]

PACKAGE = "pie:inferlet"
_STOP = "replay stopped: "  # the trap that ends a guest once it diverged (not the guest's own)
_OUTPUT_TAIL = 8192


@dataclass(frozen=True)
class Divergence:
    """Where the guest left the recording: at call `position` (0-based), why, the recorded call
    there (None past its end) and the guest's (None: the guest ended instead)."""

    position: int
    reason: str
    recorded: Call | None
    guest: tuple[str, list[Any]] | None


@dataclass
class Outcome:
    """What a replay found: `replayed` calls matched; the first divergence, if any; how the guest
    ended in the replay (event, message); `truncated`: it reached the end of a truncated recording
    (what came after was not recorded); the tail of its stdout and stderr."""

    replayed: int
    divergence: Divergence | None
    end: tuple[str, str]
    truncated: bool = False
    output: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.divergence is None


class _Replayer:
    """The recorded calls, served in order to the guest's calls."""

    def __init__(self, recording: Recording) -> None:
        self.recording = recording
        self.calls = recording.calls
        self.pos = 0
        self.divergence: Divergence | None = None
        self.at_truncation = False
        self.return_value: str | None = None

    def func(self, name: str) -> Any:
        def replayed(store: Any, *args: Any) -> Any:
            return self.next(name, store, list(args))

        return replayed

    def next(self, name: str, store: Any, args: list[Any]) -> Any:
        if self.divergence is not None or self.at_truncation:
            raise wasmtime.WasmtimeError(f"{_STOP}{name} after the end")
        pos = self.pos
        got = [_encode(a, store) for a in args]
        if pos >= len(self.calls):
            if self.recording.truncated:
                self.at_truncation = True
                raise wasmtime.WasmtimeError(f"{_STOP}the recording was truncated here")
            return self._diverge(f"the guest made a call after the recording's last ({len(self.calls)} calls)",
                                 None, name, got)
        call = self.calls[pos]
        if call.name != name:
            return self._diverge("the guest made a different call", call, name, got)
        want = [wire.dumps(a) for a in call.args]
        if got != want:
            if len(got) != len(want):
                why = f"{len(want)} arguments recorded, the guest passed {len(got)}"
            else:
                k = next(i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w)
                why = f"argument {k + 1} differs"
            return self._diverge(f"the same call with different arguments ({why})", call, name, got)
        self.pos = pos + 1
        if name == "runtime.set-return" and args and isinstance(args[0], str):
            self.return_value = args[0]
        if not call.ok:
            raise wasmtime.WasmtimeError(call.value)
        return call.value

    def _diverge(self, reason: str, call: Call | None, name: str, got: list[bytes]) -> Any:
        self.divergence = Divergence(self.pos, reason, call, (name, [wire.loads_value(g) for g in got]))
        raise wasmtime.WasmtimeError(f"{_STOP}{reason}")


def _encode(value: Any, store: Any) -> bytes:
    try:
        return wire.dumps(value, store)
    except wire.WireError as e:  # as the recorder writes it
        return wire.dumps(f"<arguments not recordable: {e}>")


def _linker(engine: wasmtime.Engine, component: Component, recording: Recording, rp: _Replayer) -> Linker:
    """WASI p2 with its monotonic clock, and every `pie:inferlet` function the component imports,
    served from the recording."""
    linker = Linker(engine)
    linker.add_wasip2()
    pollables = ReadyPollables(engine)
    helper: list[Any] = []  # its `ready` in the replay's store, once made

    def clock(name: str) -> Any:
        label = f"monotonic-clock.{name}"

        def replayed(store: Any, *args: Any) -> Any:
            value = rp.next(label, store, list(args))
            if not name.startswith("subscribe-"):
                return value
            if not helper:
                helper.append(pollables.helper(store))
            return helper[0](store)

        return replayed

    linker.allow_shadowing = True  # (over add_wasip2's clock, as the host's own)
    with linker.root() as root, root.add_instance(CLOCK_INTERFACE) as li:
        for name in CLOCK_FUNCS:
            add_func(li, name, clock(name), label=f"monotonic-clock.{name}")
    linker.allow_shadowing = False
    with linker.root() as root:
        for name, ext in component.type.imports(engine).items():
            ty = ext.ty
            if not name.startswith(f"{PACKAGE}/") or not isinstance(ty, ComponentInstanceType):
                continue
            iface = name[len(PACKAGE) + 1:].split("@", 1)[0]
            with root.add_instance(name) as li:
                items = {n: item.ty for n, item in ty.exports(engine).items()}
                for n, item in items.items():  # (resources first: the functions' types use them)
                    type_id = recording.resources.get(f"{iface}.{n}")
                    if isinstance(item, ResourceType) and type_id is not None:
                        li.add_resource(n, ResourceType.host(type_id), lambda _store, _rep: None)
                for n, item in items.items():
                    if isinstance(item, FuncType):
                        add_func(li, n, rp.func(f"{iface}.{n}"), label=f"{iface}.{n}")
    return linker


def replay(recording: Recording, component: Component, engine: wasmtime.Engine, timeout_s: float = 60.0,
           tick_s: float = 0.01) -> Outcome:
    """Run `component`'s guest against `recording` and say where, if anywhere, it diverged. The
    engine must have epoch interruption on and its epoch advanced every `tick_s` (a guest running
    past `timeout_s` is stopped: host/wasm/engine.py's `WasmEngine` does both)."""
    rp = _Replayer(recording)
    output = bytearray()
    lock = threading.Lock()

    def capture(data: bytes) -> None:
        with lock:
            output.extend(data)
            del output[:-_OUTPUT_TAIL]

    linker = _linker(engine, component, recording, rp)
    store = Store(engine)
    try:
        wasi = WasiConfig()
        wasi.stdout_custom = capture
        wasi.stderr_custom = capture
        store.set_wasi(wasi)
        store.set_epoch_deadline(max(1, int(timeout_s / tick_s)))
        end = _run(linker, store, component, rp, timeout_s)
    finally:
        linker.close()
        store.close()
    outcome = Outcome(rp.pos, rp.divergence, end, rp.at_truncation, output.decode("utf-8", "replace"))
    if outcome.divergence is None and not outcome.truncated:
        _check_end(recording, rp, outcome)
    return outcome


def _run(linker: Linker, store: Store, component: Component, rp: _Replayer, timeout_s: float) -> tuple[str, str]:
    """The guest's end in the replay, as the host would report it (event, message)."""
    try:
        inst = linker.instantiate(store, component)
        run = inst.get_func(store, "run")
        if run is None:
            return "exception", "the component exports no `run` function"
        result = run(store)
    except wasmtime.WasmtimeError as e:
        text = str(e)
        last = rp.calls[rp.pos - 1] if rp.pos else None
        if last is not None and not last.ok and last.value in text:  # the recorded trap, given back
            return "exception", last.value
        if "interrupt" in text and _STOP not in text:
            return "exception", f"the replay ran past its timeout of {timeout_s:g} s"
        return "exception", f"trap: {text.strip().splitlines()[0] if text.strip() else 'trap'}"
    if isinstance(result, str):
        return "exception", f"inferlet returned an error: {result}"
    return "completed", rp.return_value or ""


def _check_end(recording: Recording, rp: _Replayer, outcome: Outcome) -> None:
    """Every call matched so far: the guest must also have made them all and ended as recorded."""
    calls = recording.calls
    if rp.pos < len(calls):
        outcome.divergence = Divergence(rp.pos, f"the guest ended ({outcome.end[0]}: {_short(outcome.end[1])}) "
                                                f"after {rp.pos} of the {len(calls)} recorded calls",
                                        calls[rp.pos], None)
        return
    if recording.end is None:
        outcome.notes.append("the recording does not say how the instance ended")
        return
    event, message = recording.end
    got_event, got_message = outcome.end
    if event in ("aborted", "out_of_resources"):
        outcome.notes.append(f"the host ended the recorded instance ({event}: {_short(message)}); "
                             "a replay cannot reproduce that")
        return
    same = got_event == event and (
        got_message == message if event == "completed"
        else not message.startswith("inferlet returned an error:") or message.startswith(got_message))
    if not same:
        outcome.divergence = Divergence(rp.pos, f"the guest ended differently: recorded {event}: {_short(message)}; "
                                                f"replayed {got_event}: {_short(got_message)}", None, None)


def _short(text: str, limit: int = 200) -> str:
    text = text.strip().replace("\n", " | ")
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"
