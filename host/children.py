"""Child inferlets (WIT 0.5.0 `runtime.launch` and the `child-*` calls): an instance starts another
of its own tenant and talks to it.

A child is an ordinary instance launched through `Host.launch` with its parent's tenant and
priority, so the tenant's page quota, the wall budget and the launch queue apply to it as to any
launch. Its client is its parent: what it sends (`messaging.send`) waits in the parent's link to it
(`child-receive`), what the parent sends (`child-send`) reaches its `messaging.receive`, and its
end (`child-wait`) is ok(return value) or err(the reason). Bounds (`ChildLimits`, pie-serve
`--max-child-*`): how deep children nest, how many one parent runs at once, how many one tenant
runs at once, and the bytes a parent leaves unread (a child past it is terminated). A child ends
when its parent ends unless it was launched detached, which only an operator allows
(`--allow-detached-children`). Handles are per parent: a guest cannot name another's children.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from host.events import InstanceEvent

if TYPE_CHECKING:
    from host.wasm.instance import Instance

__all__ = ["ChildLimits", "Children", "Link"]


@dataclass(frozen=True)
class ChildLimits:
    max_depth: int = 4  # a client's launch is depth 0; its children 1, theirs 2, ...
    per_parent: int = 64  # children of one instance running at once
    per_tenant: int = 256  # children of one tenant's instances running at once
    max_unread_bytes: int = 4 << 20  # a child's messages its parent has not taken
    allow_detached: bool = False

    def __post_init__(self) -> None:
        for name in ("max_depth", "per_parent", "per_tenant", "max_unread_bytes"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"child limit {name} must be >= 1, got {getattr(self, name)!r}")


@dataclass
class Link:
    """A parent's view of one child: its messages not yet taken, and its end once it ended."""

    child_id: str
    parent: Instance
    detached: bool
    inbox: deque[str] = field(default_factory=deque)
    unread: int = 0
    end: tuple[bool, str] | None = None  # (completed, return value or reason)


class Children:
    """Every parent's links, and who is whose child. `launch`/`terminate`/`signal` are the host's."""

    def __init__(self, launch: Callable[..., str], terminate: Callable[[str, str], None],
                 signal: Callable[[str, str], None], limits: ChildLimits | None = None) -> None:
        self._launch, self._terminate, self._signal = launch, terminate, signal
        self.limits = limits or ChildLimits()
        self.access: Callable[[str, str], bool] | None = None  # (tenant, program hash) -> may launch
        self._lock = threading.Lock()
        self._links: dict[str, dict[int, Link]] = {}  # parent id -> handle -> link
        self._next: Counter[str] = Counter()
        self._parent: dict[str, str] = {}  # child id -> parent id (while the child runs)
        self._depth: dict[str, int] = {}
        self._running: Counter[str] = Counter()  # tenant -> children running
        self.launched = 0

    def parent_of(self, instance_id: str) -> str | None:
        with self._lock:
            return self._parent.get(instance_id)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"launched": self.launched, "running": sum(self._running.values())}

    def launch(self, parent: Instance, program: str, args: list[str], detached: bool) -> int | str:
        """A new child of `parent`: its handle, or the reason it was not started."""
        tenant = parent.pages.tenant
        program = program or parent.program
        lim = self.limits
        if detached and not lim.allow_detached:
            return ("this host does not allow detached children: a child ends with its parent "
                    "(the operator allows them with --allow-detached-children)")
        if program != parent.program and self.access is not None and not self.access(tenant, program):
            return f"unknown program {program[:80]!r}: upload it as this tenant first, or pass \"\" for this program"
        with self._lock:
            depth = self._depth.get(parent.id, 0) + 1
            mine = self._links.setdefault(parent.id, {})
            if depth > lim.max_depth:
                return f"children nest at most {lim.max_depth} deep (--max-child-depth)"
            if sum(1 for k in mine.values() if k.end is None) >= lim.per_parent:
                return f"an instance runs at most {lim.per_parent} children at once (--max-children)"
            if self._running[tenant] >= lim.per_tenant:
                return f"this tenant runs its maximum of {lim.per_tenant} children (--max-children-per-tenant)"
            self._running[tenant] += 1
        link = Link("", parent, detached)
        try:
            child_id = self._launch(program, list(args), on_event=lambda ev: self._on_event(link, ev),
                                    tenant=tenant, priority=parent.pages.priority)
        except Exception as e:  # unknown program, a full launch queue, a shut-down host
            with self._lock:
                self._give(tenant)
            return f"{type(e).__name__}: {e}" if not isinstance(e, KeyError) else f"unknown program {program[:80]!r}"
        with self._lock:
            link.child_id = child_id
            if link.end is None:  # (it may have ended already)
                self._parent[child_id] = parent.id
                self._depth[child_id] = depth
            handle = self._next[parent.id] = self._next[parent.id] + 1
            mine[handle] = link
            self.launched += 1
        return handle

    def link(self, parent: Instance, handle: int) -> Link:
        """The parent's link `handle`; KeyError (a trap: a guest bug) when it holds no such handle."""
        with self._lock:
            link = self._links.get(parent.id, {}).get(handle)
        if link is None:
            raise KeyError(f"no child with handle {handle} (never launched by this instance, or released)")
        return link

    def send(self, link: Link, message: str) -> str | None:
        if link.end is not None:
            return "the child has ended"
        try:
            self._signal(link.child_id, message)
        except KeyError:
            return "the child has ended"
        except Exception as e:  # its inbox is full
            return str(e)
        return None

    def take(self, link: Link) -> str | None:
        with link.parent.cond:
            if not link.inbox:
                return None
            msg = link.inbox.popleft()
            link.unread -= len(msg)
            return msg

    def terminate(self, link: Link, reason: str = "terminated by its parent") -> None:
        if link.end is None and link.child_id:
            try:
                self._terminate(link.child_id, reason)
            except KeyError:  # (ended meanwhile)
                pass

    def release(self, parent: Instance, handle: int) -> None:
        link = self.link(parent, handle)
        if not link.detached:
            self.terminate(link)
        with self._lock:
            self._links.get(parent.id, {}).pop(handle, None)

    def ended(self, inst: Instance) -> None:
        """An instance ended: its non-detached children are terminated, its links dropped."""
        with self._lock:
            links = self._links.pop(inst.id, {})
            self._next.pop(inst.id, None)
        for link in links.values():
            if not link.detached:
                self.terminate(link, "its parent ended")

    # ---- internals ----
    def _give(self, tenant: str) -> None:  # lock held
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]

    def _on_event(self, link: Link, ev: InstanceEvent) -> None:
        """The child's events (on its thread): its messages and its end go to the parent's link."""
        parent = link.parent
        over = False
        with parent.cond:
            if ev.event == "message":
                if link.end is None:
                    link.inbox.append(ev.message)
                    link.unread += len(ev.message)
                    over = link.unread > self.limits.max_unread_bytes
            elif ev.terminal:
                link.end = (ev.event == "completed", ev.message if ev.event == "completed"
                            else f"{ev.event}: {ev.message}")
        if ev.terminal:
            with self._lock:
                self._parent.pop(ev.instance_id, None)
                self._depth.pop(ev.instance_id, None)
                self._give(parent.pages.tenant)
        if over:
            self._terminate(ev.instance_id, f"its parent left more than {self.limits.max_unread_bytes} bytes of "
                                            "its messages unread")
        parent.wake()
