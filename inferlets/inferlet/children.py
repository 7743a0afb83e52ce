"""Child inferlets (WIT 0.5.0): start another inferlet of your tenant and talk to it.

    from inferlet import launch

    child = launch("", ["--role", "critic"])   # "": this same program; or a program hash
    child.send("review: ...")                   # reaches the child's `receive()`
    reply = child.receive(timeout_ms=30_000)    # what the child `send()`s
    result = child.wait()                       # its return value (ChildFailed if it failed)

The child runs as an instance of its own (its own pages and budget, counted against your tenant)
and ends when you end, unless launched `detached` where the operator allows it.
"""

from __future__ import annotations

from inferlet import _host

__all__ = ["Child", "ChildError", "ChildFailed", "launch", "parent"]


class ChildError(Exception):
    """The host did not start the child (unknown program, too many children, too deep)."""


class ChildFailed(Exception):
    """The child ended with an error or was terminated; the message is its reason."""


class Child:
    """A handle to a child instance; use it as a context manager to release it (terminating it if it
    still runs) on exit."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self._id: str | None = None

    @property
    def id(self) -> str:
        if self._id is None:
            self._id = _host.runtime.child_id(self.handle)
        return self._id

    def send(self, message: str) -> None:
        """Deliver `message` to the child's `receive()`; ChildError once it has ended."""
        try:
            _host.runtime.child_send(self.handle, message)
        except _host.Err as e:
            raise ChildError(str(e.value)) from None

    def receive(self, timeout_ms: int | None = None) -> str | None:
        """The child's next `send()`; None on timeout, or when it has ended and sent nothing more."""
        return _host.runtime.child_receive(self.handle, timeout_ms)

    def poll(self, timeout_ms: int | None = 0) -> tuple[bool, str] | None:
        """None while the child runs (waiting up to `timeout_ms`); else (completed, value or reason)."""
        got = _host.runtime.child_wait(self.handle, timeout_ms)
        if got is None:
            return None
        if isinstance(got, _host.Err):
            return False, str(got.value)
        return True, _ok_value(got)

    def wait(self, timeout_ms: int | None = None) -> str:
        """Wait for the child to end and return its return value; ChildFailed if it failed,
        TimeoutError if it still runs after `timeout_ms`."""
        got = self.poll(timeout_ms)
        if got is None:
            raise TimeoutError(f"child {self.handle} still runs after {timeout_ms} ms")
        completed, value = got
        if not completed:
            raise ChildFailed(value)
        return value

    def terminate(self) -> None:
        _host.runtime.child_terminate(self.handle)

    def release(self) -> None:
        """Forget the handle (a running, non-detached child is terminated)."""
        _host.runtime.child_release(self.handle)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _ok_value(got: object) -> str:
    # componentize-py returns an `Ok` wrapper for a result inside an option; the fake host a plain str
    return str(getattr(got, "value", got))


def launch(program: str = "", args: list[str] | tuple[str, ...] = (), detached: bool = False) -> Child:
    """Start a child inferlet: `program` a program hash your tenant may launch ("" for this one)."""
    try:
        handle = _host.runtime.launch(program, list(args), detached)
    except _host.Err as e:
        raise ChildError(str(e.value)) from None
    return Child(handle)


def parent() -> str | None:
    """The instance id of the parent that launched this instance (None for a client's launch)."""
    return _host.runtime.parent()
