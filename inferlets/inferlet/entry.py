"""The export glue: turns a user module's `main(args)` into the world's `run` export."""

from __future__ import annotations

# Modules an inferlet may import lazily that componentize-py would otherwise leave out: only
# modules imported while the component is pre-initialized at build time are in its snapshot
# (argparse imports gettext -> locale only when a parser is created).
import gettext  # noqa: F401
import locale  # noqa: F401
import traceback
from collections.abc import Callable
from types import ModuleType

from inferlet import _host

__all__ = ["make_world", "InferletError", "HelpRequested"]

Main = Callable[[list[str]], "str | None"]


class InferletError(RuntimeError):
    """An error the inferlet reports as its end reason, without a traceback (e.g. bad arguments)."""


class HelpRequested(Exception):  # noqa: N818 - not an error: the way out of main() for --help
    """Raised by `ArgumentParser` on -h/--help: `run_main` returns `text` as the instance's value."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


def run_main(main: Main) -> None:
    """Call `main(args)`; a returned string becomes the return value, any exception an `Err`.

    The `Err` carries the Python traceback, so the host (and `pie-run`) can say why the
    instance ended. `InferletError` carries just its message.
    """
    try:
        _prefetch_model_constants()
        args = list(_host.runtime.arguments())
        result = main(args)
        if result is not None:
            if not isinstance(result, str):
                raise TypeError(f"main() must return str or None, not {type(result).__name__}")
            _host.runtime.set_return(result)
    except HelpRequested as h:
        _host.runtime.set_return(h.text)
    except InferletError as e:
        raise _host.Err(f"{type(e).__name__}: {e}") from None
    except BaseException as e:  # noqa: BLE001 - every guest failure becomes the instance's end reason
        if isinstance(e, _host.Err):
            raise
        raise _host.Err("".join(traceback.format_exception(e)).rstrip()) from None


def _prefetch_model_constants() -> None:
    """Ask for the model's stop tokens and chat template before the arguments, into the SDK's model.

    Why: the host answers such constants while the instance warms, before its launch (WIT imports
    declared `before_launch`: the same answer for every launch), and a warm instance waits for its
    launch at `runtime.arguments`. So a launched `text_completion` makes 4 host calls before its
    first forward instead of 6. A host that answers them only after the launch (one built before)
    parks the instance here instead: the same calls, in a different place."""
    from inferlet.model import _MODEL

    _MODEL.stop_tokens  # noqa: B018 - the properties fetch and cache
    _MODEL.chat_template  # noqa: B018


def make_world(module: ModuleType) -> type:
    """The `WitWorld` class componentize-py exports, calling `module.main`."""
    main = getattr(module, "main", None)
    if not callable(main):
        raise TypeError(
            f"inferlet module {module.__name__!r} must define `def main(args: list[str]) -> str | None`"
        )

    user_main: Main = main

    class WitWorld:
        def run(self) -> None:
            run_main(user_main)

    return WitWorld
