"""WIT interface `runtime`: version, identity, arguments, return value, log, clock, priority, and (0.5.0)
child inferlets (host/children.py)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from wasmtime.component import Variant

from host.api.guest import Begun, GuestError, Import, guest_import, timeout_s
from host.children import Children, Link
from host.levels import check_priority
from host.replicas import Replica
from host.wasm.instance import Instance

log = logging.getLogger(__name__)


def imports(wit_version: str, replicas: Sequence[Replica], children: Children | None = None) -> dict[str, Import]:
    @guest_import("runtime.version")
    def version(inst: Instance) -> str:
        return wit_version

    @guest_import("runtime.instance-id")
    def instance_id(inst: Instance) -> str:
        return inst.id

    def arguments_now(inst: Instance) -> Begun:
        return Begun.now(inst.args)

    @guest_import("runtime.arguments", begin=arguments_now)
    def arguments(inst: Instance) -> list[str]:
        return inst.args

    @guest_import("runtime.set-return")
    def set_return(inst: Instance, value: str) -> None:
        inst.return_value = value

    @guest_import("runtime.log")
    def log_line(inst: Instance, message: str) -> None:
        log.debug("[%s] %s", inst.id[:8], message)
        inst.log_line("log", message)

    @guest_import("runtime.elapsed-ms")
    def elapsed_ms(inst: Instance) -> int:
        return inst.elapsed_ms()

    @guest_import("runtime.set-priority")
    def set_priority(inst: Instance, priority: int) -> None:
        # A bad value is a guest bug: check_priority's ValueError traps it, naming the call and value.
        # The instance's thread is the caller, so it runs (not queued, not ended): its scheduler
        # holds its class, and takes the new one from its next queued forward on (host/levels.py).
        check_priority(priority)
        inst.pages.priority = priority
        replicas[inst.pages.replica].scheduler.set_class(inst.id, priority, inst.pages.tenant)

    @guest_import("runtime.priority")
    def get_priority(inst: Instance) -> int:
        return inst.pages.priority

    def kids() -> Children:
        if children is None:  # (a worker's local table: these calls go to the host)
            raise GuestError("child inferlets are not served here")
        return children

    def link(inst: Instance, handle: int) -> Link:
        try:
            return kids().link(inst, handle)
        except KeyError as e:
            raise GuestError(e.args[0]) from None

    @guest_import("runtime.launch")
    def launch(inst: Instance, program: str, arguments: list[str], detached: bool) -> int | str:
        inst.check_alive()
        return kids().launch(inst, program, arguments, detached)

    @guest_import("runtime.child-id")
    def child_id(inst: Instance, handle: int) -> str:
        return link(inst, handle).child_id

    @guest_import("runtime.child-send")
    def child_send(inst: Instance, handle: int, message: str) -> str | None:
        return kids().send(link(inst, handle), message)

    @guest_import("runtime.child-receive")
    def child_receive(inst: Instance, handle: int, timeout_ms: int | None) -> str | None:
        k = link(inst, handle)
        inst.wait_until(lambda: bool(k.inbox) or k.end is not None, timeout_s(timeout_ms))
        return kids().take(k)

    @guest_import("runtime.child-wait")
    def child_wait(inst: Instance, handle: int, timeout_ms: int | None) -> Variant | None:
        k = link(inst, handle)
        if not inst.wait_until(lambda: k.end is not None, timeout_s(timeout_ms)) or k.end is None:
            return None
        ok, value = k.end
        return Variant("ok" if ok else "err", value)

    @guest_import("runtime.child-terminate")
    def child_terminate(inst: Instance, handle: int) -> None:
        kids().terminate(link(inst, handle))

    @guest_import("runtime.child-release")
    def child_release(inst: Instance, handle: int) -> None:
        link(inst, handle)  # (a trap for a handle it does not hold)
        kids().release(inst, handle)

    @guest_import("runtime.parent")
    def parent(inst: Instance) -> str | None:
        return kids().parent_of(inst.id)

    return {"launch": launch, "child-id": child_id, "child-send": child_send, "child-receive": child_receive,
            "child-wait": child_wait, "child-terminate": child_terminate, "child-release": child_release,
            "parent": parent,
            "version": version, "instance-id": instance_id, "arguments": arguments,
            "set-return": set_return, "log": log_line, "elapsed-ms": elapsed_ms,
            "set-priority": set_priority, "priority": get_priority}
