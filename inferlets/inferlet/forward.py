"""`Forward`: a forward pass submitted without waiting, and `wait_any` over several."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from inferlet import _host

if TYPE_CHECKING:
    from inferlet.context import Context

__all__ = ["Forward", "wait_any"]


class Forward:
    """An in-flight forward pass from `Context.submit_decode` / `submit_dist`."""

    def __init__(self, ctx: Context, handle: int, kind: str) -> None:
        self.ctx, self.handle, self.kind = ctx, handle, kind
        self.done = False
        self.result: Any = None  # token id ("token") or (ids, probs) ("dist")

    def wait(self) -> Any:
        """Block until the pass is done; returns the sampled token or the (ids, probs) pair."""
        if not self.done:
            self._finish(_host.forward.wait(self.handle))
        return self.result

    def _finish(self, outputs: list[Any]) -> None:
        out = outputs[0]
        if self.kind == "token":
            self.result = out.token
            self.ctx._append_pending([out.token])
        else:
            self.result = (list(out.ids), list(out.probs))
        self.done = True
        self.ctx._inflight = None


def wait_any(passes: Sequence[Forward]) -> Forward:
    """Block until one of the passes is done and return it (already-done ones return at once)."""
    for f in passes:
        if f.done:
            return f
    handle, outputs = _host.forward.wait_any([f.handle for f in passes])
    for f in passes:
        if f.handle == handle:
            f._finish(outputs)
            return f
    raise RuntimeError(f"forward.wait-any returned unknown handle {handle}")
