"""Build-time warm-up: run an inferlet's start path once while `pie-build` snapshots it.

`pie-build` pre-initializes a component: it imports the app and snapshots the guest's memory, and
every instance starts from that snapshot. Code that has never run in the snapshot runs cold in
every instance: CPython 3.14 specializes its bytecode as it first runs, and in a burst of launches
the guest's Python up to its first forward (argument parsing, the chat, the SDK's bookkeeping) is
most of an instance's start. `warm_up(main, args)`, called at the end of the app module, runs
`main` against a stand-in host that lives in the guest (no host call is made: none is possible
while building), so the snapshot holds the specialized code; then it puts the real host back and
forgets what the runs left in the SDK (its page table and model facts).

Measured (a burst of 64 warm `text_completion` instances, 2 ms stand-in step, alternating builds,
medians of 9 bursts): the last instance's first forward came 25.1 ms after the launch instead of
28.1 ms (bench/HISTORY.md).

Only for a `main` whose runs change nothing but the SDK's own state: a module-level cache or
counter that `main` fills would be in the snapshot, and every instance would start with it.
A run that raises is ignored (the warm-up is best effort); the stand-in answers the calls of the
plain paths (chat, encode / encode-prompt / decode, pages, `forward.generate`, `run`, `decode-step`, `send`, `log`) and
any other host call raises inside the run: every interface is replaced, so none reaches the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from inferlet import _host
from inferlet.model import _MODEL
from inferlet.pages import PAGES

__all__ = ["warm_up"]

_PAGE_SIZE = 16


def _next(token: int) -> int:
    """The stand-in model's token after `token` (any valid id will do)."""
    return (token + 1) % 200 + 3


class _Generation:
    """The shape of WIT `forward.generation`."""

    def __init__(self, tokens: list[int], trim: int, finish: str) -> None:
        self.tokens, self.new_pages, self.trim, self.finish = tokens, [], trim, finish


class _Output:
    """The shape of WIT `forward.output`."""

    def __init__(self, token: int) -> None:
        self.token, self.ids, self.probs = token, [token], [1.0]


class _Interface:
    """One stand-in host interface: its functions, and the real one's record classes."""

    def __init__(self, real: Any, records: Sequence[str], **funcs: Callable[..., Any]) -> None:
        self._real = real
        self._records = records
        self.__dict__.update(funcs)

    def __getattr__(self, name: str) -> Any:
        if name in self._records:  # records are plain classes: the real ones, so the runs build them
            return getattr(self._real, name)
        raise RuntimeError(f"warm-up: host call {name!r} has no stand-in")


def _stand_in(saved: dict[str, Any]) -> dict[str, Any]:
    next_page = [0]

    def allocate(n: int) -> list[int]:
        next_page[0] += n
        return list(range(next_page[0] - n, next_page[0]))

    def generate(pages: list[int], last_len: int, tokens: list[int], positions: list[int], sampler: Any,
                 budget: int, stops: list[int], texts: list[str], stream: bool) -> _Generation:
        drawn = [_next(tokens[-1] + i) for i in range(min(budget, 3))]
        return _Generation(drawn + [0], 1, "stop-token") if budget > 3 else _Generation(drawn, 0, "length")

    def generate_fresh(tokens: list[int], sampler: Any, budget: int, stops: list[int], texts: list[str],
                       stream: bool, prefix_cache: bool) -> _Generation:
        pages = allocate(-(-len(tokens) // _PAGE_SIZE))
        g = generate(pages, 0, tokens, [], sampler, budget, stops, texts, stream)
        g.new_pages = pages
        return g

    def run(pages: list[int], last_len: int, tokens: list[int], positions: list[int], mask: Any,
            outputs: list[Any]) -> list[_Output]:
        return [_Output(_next(tokens[o.index])) for o in outputs]

    return {
        "model": _Interface(
            saved["model"], ("Message",),
            model_name=lambda: "warm-up", vocab_size=lambda: 256, stop_tokens=lambda: [0],
            chat_template=lambda: "<{{ role }}>", encode=lambda text: [ord(c) % 200 + 3 for c in text],
            encode_prompt=lambda text: [1] + [ord(c) % 200 + 3 for c in text],
            decode=lambda ids: "".join(chr(97 + i % 26) for i in ids),
            apply_chat_template=lambda msgs, gen: "".join(f"<{m.role}>{m.content}" for m in msgs) + ("<a>" if gen else ""),
        ),
        "kv": _Interface(
            saved["kv"], (),
            page_size=lambda: _PAGE_SIZE, attach_prefix=lambda tokens: [], allocate=allocate,
            release=lambda pages: None, free_pages=lambda: 1 << 20,
        ),
        "forward": _Interface(
            saved["forward"], ("Sampler", "OutputSpec"),
            generate=generate, generate_fresh=generate_fresh, run=run, decode_step=lambda pages, last_len, token, position, sampler: _next(token),
        ),
        "runtime": _Interface(saved["runtime"], (), log=lambda message: None, elapsed_ms=lambda: 0,
                              set_priority=lambda priority: None, priority=lambda: 0),
        "messaging": _Interface(saved["messaging"], (), send=lambda message: None),
        "store": _Interface(saved["store"], ()),
        "grammar": _Interface(saved["grammar"], ()),
        "embed": _Interface(saved["embed"], (), hidden_size=lambda: 8, image_tokens=lambda: 0,
                            image_token_id=lambda: None,
                            hidden=lambda pages, last_len, tokens, positions, embeds, pooling, normalize: [0.125] * 8),
        "http": _Interface(saved["http"], ()),
    }


def warm_up(main: Callable[[list[str]], str | None], *arg_lists: list[str], rounds: int = 2) -> int:
    """Run `main(args)` `rounds` times for each of `arg_lists` against the in-guest stand-in host,
    then restore the host and the SDK's state. Returns how many runs returned without raising."""
    saved = {name: getattr(_host, name) for name in _host.INTERFACES}  # all of them: no call reaches the host
    done = 0
    try:
        _host.bind(**_stand_in(saved))
        for _ in range(rounds):
            for args in arg_lists:
                _MODEL._reset()
                PAGES.reset()
                try:
                    main(list(args))
                except Exception:  # noqa: BLE001 - best effort: the instance runs the same code cold
                    continue
                done += 1
    finally:
        _host.bind(**saved)
        _MODEL._reset()
        PAGES.reset()
    return done
