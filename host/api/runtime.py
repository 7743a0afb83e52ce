"""WIT interface `runtime`: version, identity, arguments, return value, log, clock, priority."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from host.api.guest import Import, guest_import
from host.levels import check_priority
from host.replicas import Replica
from host.wasm.instance import Instance

log = logging.getLogger(__name__)


def imports(wit_version: str, replicas: Sequence[Replica]) -> dict[str, Import]:
    @guest_import("runtime.version")
    def version(inst: Instance) -> str:
        return wit_version

    @guest_import("runtime.instance-id")
    def instance_id(inst: Instance) -> str:
        return inst.id

    @guest_import("runtime.arguments")
    def arguments(inst: Instance) -> list[str]:
        return inst.args

    @guest_import("runtime.set-return")
    def set_return(inst: Instance, value: str) -> None:
        inst.return_value = value

    @guest_import("runtime.log")
    def log_line(inst: Instance, message: str) -> None:
        log.debug("[%s] %s", inst.id[:8], message)

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

    return {"version": version, "instance-id": instance_id, "arguments": arguments,
            "set-return": set_return, "log": log_line, "elapsed-ms": elapsed_ms,
            "set-priority": set_priority, "priority": get_priority}
