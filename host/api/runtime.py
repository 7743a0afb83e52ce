"""WIT interface `runtime`: version, identity, arguments, return value, log, clock."""

from __future__ import annotations

import logging

from host.api.guest import Import, guest_import
from host.wasm.instance import Instance

log = logging.getLogger(__name__)


def imports(wit_version: str) -> dict[str, Import]:
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

    return {"version": version, "instance-id": instance_id, "arguments": arguments,
            "set-return": set_return, "log": log_line, "elapsed-ms": elapsed_ms}
