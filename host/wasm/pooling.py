"""wasmtime's pooling instance allocator, sized from the host's limits.

Why: with the default (on-demand) allocator every instantiation maps a fresh linear memory and
every instance's end unmaps it, and each of the ~600 pages a componentize-py guest touches while
it starts is a page fault taken under the process's memory-map lock; measured here with 64
`text_completion` launches at once that was ~6-7 ms of kernel time per instance (more than the
guest's own work) and it does not get faster with more cores. The pooling allocator reserves
slots for memories, tables and instances once, reuses a slot for the same module (its memory
image stays mapped), and with `keep_resident_bytes` resets a slot's first bytes with a memset
instead of giving the pages back, so the next instance takes no page fault there: kernel time
fell to ~1 ms per instance (bench/host_scale.py; numbers in bench/HISTORY.md).

Invariants: the per-component maxima here are at least the store limits every instance runs
under (`InstanceLimits.store_limits`), so the pool never refuses what the limits allow; the
limits stay the sandbox's rule. Slots are virtual-address reservations: `slots` instances cost
address space, not memory, until used. When every slot is taken, instantiation fails with
wasmtime's "maximum concurrent ... limit" error, which `explain` turns into a message.
"""

from __future__ import annotations

import re
import resource
from dataclasses import dataclass

from wasmtime import Config
from wasmtime import _ffi as ffi

from host.wasm.limits import InstanceLimits

__all__ = ["PoolingConfig"]

# A componentize-py inferlet is 14 core instances (+1 for the clock helper, host/api/wasi.py).
_CORE_INSTANCES_PER_COMPONENT_TYPICAL = 16
_SLACK = 8  # per-component maxima this far above the store limits (see `apply`)
_VMCTX_BYTES = 1 << 20  # wasmtime's default max (core / component) instance size


@dataclass(frozen=True)
class PoolingConfig:
    """How many component instances the pool holds at once, and how much of each linear memory
    stays resident between two instances in a slot."""

    slots: int
    limits: InstanceLimits
    keep_resident_bytes: int = 16 << 20
    warm_slots: int = 256  # unused slots kept with their module's image mapped (and resident)

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"the instance pool needs at least one slot, got {self.slots}")
        if self.keep_resident_bytes < 0 or self.warm_slots < 0:
            raise ValueError("keep_resident_bytes and warm_slots must be >= 0")

    def apply(self, cfg: Config) -> None:
        """Switch `cfg` to the pooling allocator with these sizes."""
        s = self.limits.store_limits
        p = ffi.wasmtime_pooling_allocation_config_new()
        n = self.slots
        typical = min(_CORE_INSTANCES_PER_COMPONENT_TYPICAL, s.instances)
        # Per-component maxima above the store limits: a component past a limit is then refused by
        # the store at instantiation with the limit's own message (InstanceLimits.explain), not
        # by the pool at compile time with wasmtime's.
        memories, tables, instances = s.memories + _SLACK, s.tables + _SLACK, s.instances + _SLACK
        ffi.wasmtime_pooling_allocation_config_total_component_instances_set(p, n)
        ffi.wasmtime_pooling_allocation_config_total_core_instances_set(p, n * typical + instances)
        ffi.wasmtime_pooling_allocation_config_total_memories_set(p, n * s.memories + memories)
        ffi.wasmtime_pooling_allocation_config_total_tables_set(p, n * s.tables + tables)
        ffi.wasmtime_pooling_allocation_config_max_core_instances_per_component_set(p, instances)
        ffi.wasmtime_pooling_allocation_config_max_memories_per_component_set(p, memories)
        ffi.wasmtime_pooling_allocation_config_max_tables_per_component_set(p, tables)
        ffi.wasmtime_pooling_allocation_config_max_memories_per_module_set(p, memories)
        ffi.wasmtime_pooling_allocation_config_max_tables_per_module_set(p, tables)
        ffi.wasmtime_pooling_allocation_config_max_memory_size_set(p, s.memory_size)
        ffi.wasmtime_pooling_allocation_config_table_elements_set(p, s.table_elements)
        ffi.wasmtime_pooling_allocation_config_max_core_instance_size_set(p, _VMCTX_BYTES)
        ffi.wasmtime_pooling_allocation_config_max_component_instance_size_set(p, _VMCTX_BYTES)
        ffi.wasmtime_pooling_allocation_config_linear_memory_keep_resident_set(p, self.keep_resident_bytes)
        ffi.wasmtime_pooling_allocation_config_table_keep_resident_set(p, min(self.keep_resident_bytes, 1 << 20))
        ffi.wasmtime_pooling_allocation_config_max_unused_warm_slots_set(p, self.warm_slots)
        ffi.wasmtime_pooling_allocation_strategy_set(cfg.ptr(), p)
        ffi.wasmtime_pooling_allocation_config_delete(p)

    @staticmethod
    def address_space_ok() -> bool:
        """Whether the process may reserve the pool's address space: wasmtime reserves ~4 GiB of
        it per memory slot up front and aborts the process (a Rust panic, not an exception) when
        it cannot, so under any `ulimit -v` the host keeps the on-demand allocator."""
        soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        return soft == resource.RLIM_INFINITY

    def explain(self, wasmtime_message: str) -> str | None:
        """A message for an instantiation refused because the pool is full; None if it was not."""
        if re.search(r"maximum concurrent (.* )?limit of \d+ .*reached", wasmtime_message):
            return (f"the host's instance pool is full ({self.slots} instances at once); "
                    "wait for instances to end, or start the host with a larger --max-instances")
        return None
