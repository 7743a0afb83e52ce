"""WASI clock waits the host can interrupt: `wasi:clocks/monotonic-clock`, provided by the host.

wasmtime's own clock pollables block inside wasmtime (a Python guest's `time.sleep` is
`subscribe-instant` + `wasi:io/poll.poll`), where neither epoch ticks nor `Instance.terminate`
reach: a guest asleep there outlived its budget and kept its thread and pages until it woke.

This module replaces `wasi:clocks/monotonic-clock` (linker shadowing, over `add_wasip2`); the
rest of WASI, `wasi:io/poll` included, stays wasmtime's. A subscription waits for its instant
right away, in `Instance.wait_until` (so a terminate or the end of the wall-clock budget ends it
at once), and then returns a pollable that is already ready, so the guest's `poll` returns at
once. The pollable must be wasmtime's own resource (`wasi:io/poll` owns the type and drops it),
which Python cannot create: a small helper component, instantiated in the instance's store on
its first subscription, makes it with wasmtime's `subscribe-duration(0)`.

What changes for a guest: the wait happens when it subscribes, not when it polls. A guest that
polls a timer together with a stream sees the stream only after the timer; an inferlet has no
stdin and no sockets, and `time.sleep` / `time.monotonic` in a Python guest behave as before.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from wasmtime import Engine
from wasmtime.component import Component, Func, Linker, ResourceAny

from host.api.fastcall import add_func
from host.api.guest import Import, guest_import
from host.wasm.instance import Instance

__all__ = ["CLOCK_FUNCS", "CLOCK_INTERFACE", "ReadyPollables", "WASI_VERSION", "add_clock_waits"]

# The WASI version that wasmtime-py's `add_wasip2` defines (0.2.12 in wasmtime-py 50.0.1).
# Shadowing must use the same name: a guest importing any 0.2.x gets the latest 0.2 definition
# the linker holds. tests/test_isolation_wasm.py fails if the shadow stops applying.
WASI_VERSION = "0.2.12"
CLOCK_INTERFACE = f"wasi:clocks/monotonic-clock@{WASI_VERSION}"
CLOCK_FUNCS = ("now", "resolution", "subscribe-instant", "subscribe-duration")  # (host/replay/ serves them too)
_CHUNK_S = 3600.0  # a very long wait is waited in pieces (Condition.wait has a maximum)

# Exports `ready`: a wasmtime pollable that is ready at once (subscribe-duration(0)).
_READY_POLLABLE_WAT = """
(component
  (import "wasi:io/poll@0.2.0" (instance $poll (export "pollable" (type (sub resource)))))
  (alias export $poll "pollable" (type $pollable))
  (import "wasi:clocks/monotonic-clock@0.2.0" (instance $clock
    (alias outer 1 $pollable (type $p))
    (export "pollable" (type (eq $p)))
    (export "subscribe-duration" (func (param "when" u64) (result (own $p))))))
  (alias export $clock "subscribe-duration" (func $sub))
  (core func $sub_lowered (canon lower (func $sub)))
  (core module $m
    (import "clock" "sub" (func $sub (param i64) (result i32)))
    (func (export "ready") (result i32) (call $sub (i64.const 0))))
  (core instance $i (instantiate $m (with "clock" (instance (export "sub" (func $sub_lowered))))))
  (func (export "ready") (result (own $pollable)) (canon lift (core func $i "ready"))))
"""


class ReadyPollables:
    """Makes ready wasmtime pollables in an instance's store (one helper instance per store)."""

    def __init__(self, engine: Engine) -> None:
        self.component = Component(engine, _READY_POLLABLE_WAT)
        self.linker = Linker(engine)
        self.linker.add_wasip2()  # wasmtime's own clock: the helper's pollable is wasmtime's type

    def helper(self, store: Any) -> Func:
        """The helper's `ready` function, instantiated in `store` (call once per store)."""
        ready = self.linker.instantiate(store, self.component).get_func(store, "ready")
        assert ready is not None  # the helper component exports it
        return ready

    def make(self, store: Any, inst: Instance) -> ResourceAny:
        if inst.wasi_helper is None:
            inst.wasi_helper = self.helper(store)
        pollable: ResourceAny = inst.wasi_helper(store)
        return pollable


def _sleep_until(inst: Instance, deadline_ns: int) -> None:
    """Wait until `deadline_ns` (monotonic); raises Terminated at a terminate or the budget's end."""
    while (left_ns := deadline_ns - time.monotonic_ns()) > 0:
        inst.wait_until(lambda: time.monotonic_ns() >= deadline_ns, min(left_ns / 1e9, _CHUNK_S))


def clock_imports(ready: ReadyPollables) -> dict[str, Import]:
    """`wasi:clocks/monotonic-clock`: now, resolution, subscribe-instant, subscribe-duration."""

    @guest_import("wasi:clocks/monotonic-clock.now")
    def now(inst: Instance) -> int:
        return time.monotonic_ns()

    @guest_import("wasi:clocks/monotonic-clock.resolution")
    def resolution(inst: Instance) -> int:
        return max(1, int(time.get_clock_info("monotonic").resolution * 1e9))

    def subscribe(name: str, deadline_of: Callable[[int], int]) -> Import:
        @guest_import(f"wasi:clocks/monotonic-clock.{name}")
        def wait_then_ready(inst: Instance, store: Any, arg: int) -> ResourceAny:
            _sleep_until(inst, deadline_of(arg))
            return ready.make(store, inst)

        return lambda store, arg: wait_then_ready(store, store, arg)  # the helper lives in `store`

    return {"now": now, "resolution": resolution,
            "subscribe-instant": subscribe("subscribe-instant", lambda when: when),
            "subscribe-duration": subscribe("subscribe-duration", lambda d: time.monotonic_ns() + d)}


def add_clock_waits(linker: Linker, engine: Engine) -> None:
    """Replace wasmtime's `wasi:clocks/monotonic-clock` in `linker` (call after `add_wasip2`)."""
    table = clock_imports(ReadyPollables(engine))
    linker.allow_shadowing = True
    with linker.root() as root, root.add_instance(CLOCK_INTERFACE) as li:
        for name, fn in table.items():  # (labelled for the recorder: host/replay/)
            add_func(li, name, fn, label=f"monotonic-clock.{name}")
    linker.allow_shadowing = False
