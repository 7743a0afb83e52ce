"""WIT interface `kv`: KV pages: allocate, release, export/import by name, copy tokens."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from host.api.guest import Begun, GuestError, Import, guest_import
from host.batching.future import CopyRequest
from host.replicas import ExportNames, Replica
from host.suspend import OutOfResources
from host.wasm.instance import Instance


def imports(replicas: Sequence[Replica], names: ExportNames, page_size: int) -> dict[str, Import]:
    """The `kv` imports: each reaches its instance's replica (`inst.pages.replica`)."""
    @guest_import("kv.page-size", keeps_lookahead=True, before_launch=True)
    def kv_page_size(inst: Instance) -> int:
        return page_size

    @guest_import("kv.free-pages", keeps_lookahead=True)
    def free_pages(inst: Instance) -> int:
        return replicas[inst.pages.replica].pages.free_count

    @guest_import("kv.allocate", keeps_lookahead=True)  # the next step's own page
    def kv_allocate(inst: Instance, count: int) -> list[int] | str:
        return allocate(replicas[inst.pages.replica], inst, count)

    def release_now(inst: Instance, pages: list[int]) -> Begun | None:
        rep = replicas[inst.pages.replica]
        gate = rep.gate_now(inst)
        if gate is None:
            return None
        try:
            rep.pages.release(inst.pages, pages)
        finally:
            gate.__exit__(None, None, None)
        return Begun.now(None)

    @guest_import("kv.release", begin=release_now)
    def release(inst: Instance, pages: list[int]) -> None:
        rep = replicas[inst.pages.replica]
        with rep.gate(inst):
            rep.pages.release(inst.pages, pages)

    @guest_import("kv.export-pages")
    def export_pages(inst: Instance, name: str, pages: list[int], persistent: bool) -> str | None:
        with replicas[inst.pages.replica].gate(inst):
            return names.export(inst.pages, name, pages, persistent)

    @guest_import("kv.import-pages")
    def import_pages(inst: Instance, name: str) -> list[int] | str:
        with replicas[inst.pages.replica].gate(inst):
            return names.import_(inst.pages, name)

    @guest_import("kv.unexport")
    def unexport(inst: Instance, name: str) -> str | None:
        return names.unexport(inst.pages, name)

    @guest_import("kv.list-exports", keeps_lookahead=True)
    def list_exports(inst: Instance) -> list[tuple[str, int]]:
        return replicas[inst.pages.replica].pages.list_exports(inst.pages)

    @guest_import("kv.attach-prefix")
    def attach_prefix(inst: Instance, tokens: list[int]) -> list[int]:
        inst.check_alive()
        rep = replicas[inst.pages.replica]
        with rep.gate(inst):
            return rep.pages.attach_prefix(inst.pages, tokens)

    @guest_import("kv.copy-tokens")
    def copy_tokens(inst: Instance, src_page: int, src_off: int, dst_page: int, dst_off: int, count: int) -> None:
        rep = replicas[inst.pages.replica]
        _copy_tokens(rep, page_size, inst, CopyRequest(src_page, src_off, dst_page, dst_off, count, inst.label))

    return {"page-size": kv_page_size, "free-pages": free_pages, "allocate": kv_allocate, "release": release,
            "export-pages": export_pages, "import-pages": import_pages, "unexport": unexport,
            "list-exports": list_exports, "copy-tokens": copy_tokens, "attach-prefix": attach_prefix}


def allocate(rep: Replica, inst: Instance, count: int) -> list[int] | str:
    """`count` fresh pages for `inst` (its ids for them), waiting for room under KV pressure
    (host/suspend.py); an error string the guest can handle; an allocation that can never be met
    ends the instance with `out_of_resources`."""
    inst.check_alive()
    if rep.suspender is None:
        return rep.pages.allocate(inst.pages, count)
    try:
        return rep.suspender.allocate(inst, count)
    except OutOfResources as e:
        inst.terminate(str(e), "out_of_resources")
        inst.check_alive()
        raise


def _copy_tokens(rep: Replica, page_size: int, inst: Instance, c: CopyRequest) -> None:
    """Through the scheduler: the copy runs after this instance's forwards submitted before it."""
    inst.check_alive()
    pm = rep.pages
    with rep.gate(inst):
        pm.check_pages(inst.pages, [c.src_page], writable_from=1)
        pm.check_writable(inst.pages, c.dst_page)
        if c.src_offset + c.count > page_size or c.dst_offset + c.count > page_size:
            raise GuestError(f"copy of {c.count} tokens at offsets {c.src_offset}/{c.dst_offset} runs past "
                             f"the page size {page_size}")
        if c.count == 0:
            return
        src, dst = pm.to_phys(inst.pages, [c.src_page, c.dst_page])
        c = dataclasses.replace(c, src_page=src, dst_page=dst)
        pm.note_copy(inst.pages, dst, c.dst_offset + c.count)
        fut = rep.scheduler.submit(c, inst.id)
    inst.wait_for(fut)
