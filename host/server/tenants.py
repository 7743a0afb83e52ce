"""Per-tenant shares of the server: running instances and open connections, each with a cap.

One `TenantLimits` per server counts, for every tenant, the instances it has running (launched
over the WebSocket protocol or the OpenAI routes) and its connections (WebSocket connections
once authenticated, HTTP requests in progress), so one tenant cannot take what another needs.
Invariant: every `take_*` that returned is matched by exactly one `give_*`. Runs on the
server's event loop only.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["TenantLimits", "TenantLimitError"]


class TenantLimitError(Exception):
    """A tenant is at one of its caps; the message names it and the flag that sets it."""


class TenantLimits:
    """Counts and caps per tenant. `max_instances` None = no per-tenant instance cap."""

    def __init__(self, max_instances: int | None, max_connections: int) -> None:
        self.max_instances = max_instances
        self.max_connections = max_connections
        self.instances: Counter[str] = Counter()
        self.connections: Counter[str] = Counter()

    def take_instance(self, tenant: str) -> None:
        """Count one more running instance for `tenant`; TenantLimitError at its cap."""
        cap = self.max_instances
        if cap is not None and self.instances[tenant] >= cap:
            raise TenantLimitError(f"tenant {tenant!r} runs its maximum of {cap} instances; try again when "
                                   "some have ended (--max-instances-per-tenant)")
        self.instances[tenant] += 1

    def give_instance(self, tenant: str) -> None:
        self.instances[tenant] -= 1
        if self.instances[tenant] <= 0:
            del self.instances[tenant]

    def take_connection(self, tenant: str) -> None:
        """Count one more connection (or HTTP request in progress) for `tenant`; TenantLimitError at its cap."""
        if self.connections[tenant] >= self.max_connections:
            raise TenantLimitError(f"tenant {tenant!r} has its maximum of {self.max_connections} connections open "
                                   "(--max-connections-per-tenant)")
        self.connections[tenant] += 1

    def give_connection(self, tenant: str) -> None:
        self.connections[tenant] -= 1
        if self.connections[tenant] <= 0:
            del self.connections[tenant]
