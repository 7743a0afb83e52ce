"""One instance's page table (`InstancePages`), the page errors, and the suspension states.

A guest's page ids are its own: the same as the physical page while the instance has never been
suspended, and mapped to another one after it was resumed into whatever pages were free
(`phys` / `guest`, empty when identical, so the common path does no translation). While
suspended, its own pages' K/V sit in host memory (host/suspend.py) and their ids map to SWAPPED.
The page manager (host/state/pages.py) owns the tables' contents; this module only defines them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["ACTIVE", "RESUMING", "SUSPENDED", "SUSPENDING", "SWAPPED", "Cancellable", "InstancePages", "PageError"]


class Cancellable(Protocol):
    """A host-side generation loop as a page table sees it (host/batching/generation.py's `Generation`)."""

    def cancel(self, reason: str) -> None:
        """End the loop at its next step with `reason` (a suspension ends it with out-of-pages)."""


SWAPPED = -1  # InstancePages.phys value of a page whose K/V is in host memory while its instance is suspended

# InstancePages.state (host/suspend.py)
ACTIVE, SUSPENDING, SUSPENDED, RESUMING = "active", "suspending", "suspended", "resuming"


class PageError(Exception):
    """Guest misuse of page ids (a bug: the caller traps the instance)."""


@dataclass
class InstancePages:
    """The pages one instance holds: page -> [hold count, writable]."""

    owner: str
    tenant: str = "local"  # whose export names this instance sees (set by the host at launch)
    priority: int = 0  # its service level (host/levels.py: lower runs sooner; set at launch, runtime.set-priority)
    held: dict[int, list] = field(default_factory=dict)
    owned_count: int = 0  # pages this instance allocated and still holds (for its cap)
    replica: int = 0  # the engine replica the instance lives on (host/replicas.py); its pages are that one's
    drops: int = 0  # pages this instance stopped holding, ever: a page list checked before may be stale
    # the page list of its last per-token pass, found held and free of repeats while `drops` was
    # `checked_drops` (PageManager.check_step_pages)
    checked: list[int] = field(default_factory=list)
    checked_set: set[int] = field(default_factory=set)
    checked_drops: int = -1
    checked_phys: list[int] = field(default_factory=list)  # `checked` translated (when `phys` is not empty)
    # guest id -> physical page where they differ, and back (both empty until a resume moved a page;
    # a swapped-out page maps to SWAPPED). Synthetic guest ids count up from `next_id` (>= num_pages).
    phys: dict[int, int] = field(default_factory=dict)
    guest: dict[int, int] = field(default_factory=dict)
    next_id: int = 0
    # suspension (host/suspend.py): the state, guarded by `touch`, which the instance's thread holds
    # from checking it to having pinned the pages a call queues work on
    state: str = ACTIVE
    touch: threading.Lock = field(default_factory=threading.Lock)
    ended: bool = False  # release_all ran: nothing may be restored into this table
    moves: int = 0  # suspensions so far: work prepared on the physical pages of before is stale
    swapped: list[int] = field(default_factory=list)  # guest ids of the pages swapped out, in order
    swap_filled: list[int] = field(default_factory=list)  # their `filled` marks
    swap: object = None  # the backend's host-memory copy of their K/V
    swap_bytes: int = 0
    gate: object = None  # host/suspend.py's gate for this instance's page-touching calls
    loop: Cancellable | None = None  # the host-side generation loop it runs (ended with out-of-pages to suspend it)
