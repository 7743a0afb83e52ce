"""A fake host for running inferlet code in plain CPython (unit tests, debugging).

    host = FakeHost(page_size=4, num_pages=32).install()
    ...  # use inferlet.Context etc.
    assert host.kv.held == set()

It checks calls the way the real host does and raises `FakeTrap` where the real host would trap
the instance. The "model" is tiny and deterministic: tokens are UTF-8 bytes (id = byte + 3;
ids 0-2 are <s>, </s>, <|im_end|>), and the next token is a function of the (token, position)
pairs the last row attends to, so a wrong page, length or mask changes the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from inferlet import _host

__all__ = ["FakeHost", "FakeTrap", "SPECIALS"]

SPECIALS = ["<s>", "</s>", "<|im_end|>"]
_OFFSET = len(SPECIALS)
VOCAB = 256 + _OFFSET


class FakeTrap(Exception):
    """The real host would trap the instance here."""


@dataclass
class WitSampler:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None


@dataclass
class WitOutputSpec:
    index: int
    sample: WitSampler | None
    dist: int


@dataclass
class WitOutput:
    token: int | None
    ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)


@dataclass
class WitMessage:
    role: str
    content: str


@dataclass
class Request:
    """One recorded forward pass."""

    pages: list[int]
    last_page_len: int
    tokens: list[int]
    positions: list[int]
    mask: list[list[int]]
    outputs: list[WitOutputSpec]


def _trap(call: str, why: str) -> FakeTrap:
    return FakeTrap(f"{call}: {why}")


class _Runtime:
    def __init__(self, args: list[str]) -> None:
        self.args = args
        self.returned: str | None = None
        self.logs: list[str] = []

    def version(self) -> str:
        return "0.1.0-fake"

    def instance_id(self) -> str:
        return "fake-instance"

    def arguments(self) -> list[str]:
        return list(self.args)

    def set_return(self, value: str) -> None:
        self.returned = value

    def log(self, message: str) -> None:
        self.logs.append(message)

    def elapsed_ms(self) -> int:
        return 0


class _Messaging:
    def __init__(self) -> None:
        self.sent: list[str] = []
        self.inbox: list[str] = []
        self.topics: set[str] = set()
        self.published: list[tuple[str, str]] = []

    def send(self, message: str) -> None:
        self.sent.append(message)

    def receive(self, timeout_ms: int | None) -> str | None:
        return self.inbox.pop(0) if self.inbox else None

    def publish(self, topic: str, message: str) -> None:
        if topic in self.topics:
            self.published.append((topic, message))

    def subscribe(self, topic: str) -> None:
        self.topics.add(topic)

    def unsubscribe(self, topic: str) -> None:
        self.topics.discard(topic)

    def receive_published(self, timeout_ms: int | None) -> tuple[str, str] | None:
        return self.published.pop(0) if self.published else None


class _Store:
    def __init__(self) -> None:
        self.data: dict[str, str] = {}

    def get(self, key: str) -> str | None:
        return self.data.get(key)

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def delete(self, key: str) -> None:
        self.data.pop(key, None)

    def exists(self, key: str) -> bool:
        return key in self.data

    def list_keys(self) -> list[str]:
        return list(self.data)


class _Model:
    Message = WitMessage

    def available_models(self) -> list[str]:
        return ["fake"]

    def load_model(self, name: str) -> None:
        if name != "fake":
            raise _host.Err(f"unknown model {name!r}; available: fake")

    def model_name(self) -> str:
        return "fake"

    def vocab_size(self) -> int:
        return VOCAB

    def stop_tokens(self) -> list[int]:
        return [1, 2]

    def chat_template(self) -> str:
        return "chatml"

    def apply_chat_template(self, messages: list[WitMessage], add_generation_prompt: bool) -> str:
        text = "".join(f"<s>{m.role}\n{m.content}<|im_end|>\n" for m in messages)
        return text + ("<s>assistant\n" if add_generation_prompt else "")

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        while text:
            special = next((i for i, s in enumerate(SPECIALS) if text.startswith(s)), None)
            if special is not None:
                ids.append(special)
                text = text[len(SPECIALS[special]) :]
            else:
                ids.extend(b + _OFFSET for b in text[0].encode())
                text = text[1:]
        return ids

    def decode(self, tokens: list[int]) -> str:
        out, buf = [], bytearray()
        for t in tokens:
            if t < _OFFSET:
                out.append(buf.decode(errors="replace") + SPECIALS[t])
                buf.clear()
            else:
                buf.append(t - _OFFSET)
        # Like the real host: an incomplete UTF-8 sequence at the end is dropped.
        for cut in range(len(buf), max(len(buf) - 4, -1), -1):
            try:
                out.append(buf[:cut].decode())
                break
            except UnicodeDecodeError:
                continue
        else:
            out.append(buf.decode(errors="replace"))
        return "".join(out)


class _Kv:
    def __init__(self, page_size: int, num_pages: int, max_pages: int | None) -> None:
        self.ps, self.max_pages = page_size, max_pages
        self.free = list(range(num_pages - 1, -1, -1))
        self.num_pages = num_pages
        self.slots: dict[int, list[tuple[int, int] | None]] = {}  # page -> (token, position) per slot
        self.holds: dict[int, list[Any]] = {}  # page -> [hold count, writable], like host/kv.py
        self.exports: dict[str, list[int]] = {}
        self.export_refs: dict[int, int] = {}
        self.allocations = 0

    @property
    def held(self) -> set[int]:
        return set(self.holds)

    @property
    def owned(self) -> set[int]:
        return {p for p, (_, w) in self.holds.items() if w}

    @property
    def imported(self) -> set[int]:
        return {p for p, (_, w) in self.holds.items() if not w}

    def page_size(self) -> int:
        return self.ps

    def free_pages(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if self.max_pages is not None and len(self.owned) + count > self.max_pages:
            raise _host.Err(f"instance page limit {self.max_pages} reached")
        if count > self.num_pages:
            raise _host.Err(f"requested {count} KV pages but the host has only {self.num_pages} in total")
        if count > len(self.free):
            raise _host.Err(f"out of KV pages: {count} asked, {len(self.free)} free")
        pages = [self.free.pop() for _ in range(count)]
        for p in pages:
            self.holds[p] = [1, True]
            self.slots[p] = [None] * self.ps
        self.allocations += 1
        return pages

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self.holds:
                raise _trap("kv.release", f"page {p} is not held by this instance")
            self.holds[p][0] -= 1
            if self.holds[p][0] == 0:
                del self.holds[p]
            self._maybe_free(p)

    def _maybe_free(self, p: int) -> None:
        if p not in self.holds and self.export_refs.get(p, 0) == 0:
            self.slots.pop(p, None)
            self.free.append(p)

    def export_pages(self, name: str, pages: list[int], persistent: bool) -> None:
        if name in self.exports:
            raise _host.Err(f"export name {name!r} is taken")
        for p in pages:
            if p not in self.held:
                raise _trap("kv.export-pages", f"page {p} is not held by this instance")
            self.export_refs[p] = self.export_refs.get(p, 0) + 1
        self.exports[name] = list(pages)

    def import_pages(self, name: str) -> list[int]:
        if name not in self.exports:
            raise _host.Err(f"no export named {name!r}")
        for p in self.exports[name]:
            self.holds.setdefault(p, [0, False])[0] += 1
        return list(self.exports[name])

    def unexport(self, name: str) -> None:
        if name not in self.exports:
            raise _host.Err(f"no export named {name!r}")
        for p in self.exports.pop(name):
            self.export_refs[p] -= 1
            self._maybe_free(p)

    def list_exports(self) -> list[tuple[str, int]]:
        return [(n, len(p)) for n, p in self.exports.items()]

    def copy_tokens(self, src_page: int, src_offset: int, dst_page: int, dst_offset: int, count: int) -> None:
        if src_page not in self.held:
            raise _trap("kv.copy-tokens", f"source page {src_page} is not held")
        if dst_page not in self.owned:
            raise _trap("kv.copy-tokens", f"destination page {dst_page} is not owned")
        if src_offset + count > self.ps or dst_offset + count > self.ps:
            raise _trap("kv.copy-tokens", f"{count} slots do not fit at offsets {src_offset}/{dst_offset}")
        self.slots[dst_page][dst_offset : dst_offset + count] = self.slots[src_page][
            src_offset : src_offset + count
        ]


class _Forward:
    Sampler, OutputSpec, Output = WitSampler, WitOutputSpec, WitOutput

    def __init__(self, kv: _Kv) -> None:
        self.kv = kv
        self.requests: list[Request] = []
        self.results: dict[int, list[WitOutput]] = {}
        self.next_handle = 1
        self.script: list[int] = []  # when set, sampled tokens are taken from here in order
        self.decode_step_calls = 0  # passes that came through decode_step (also in `requests`)

    def run(self, pages, last_page_len, tokens, positions, mask, outputs) -> list[WitOutput]:  # noqa: ANN001
        req = Request(
            list(pages), last_page_len, list(tokens), list(positions), [list(r) for r in mask], list(outputs)
        )
        self.requests.append(req)
        ps, kv = self.kv.ps, self.kv
        if not pages or not 1 <= last_page_len <= ps:
            raise _trap("forward", f"last-page-len {last_page_len} out of 1..{ps} ({len(pages)} pages)")
        total = (len(pages) - 1) * ps + last_page_len
        ctx = total - len(tokens)
        if ctx < 0 or len(positions) != len(tokens):
            raise _trap(
                "forward", f"{len(tokens)} tokens / {len(positions)} positions do not fit {total} slots"
            )
        for p in pages:
            if p not in kv.held:
                raise _trap("forward", f"page {p} is not held by this instance")
        if mask and len(mask) != len(tokens):
            raise _trap("forward", f"mask has {len(mask)} rows for {len(tokens)} tokens")
        for i, row in enumerate(mask):
            if sum(row) != ctx + i + 1 or min(row, default=0) < 0:
                raise _trap("forward", f"mask row {i} sums to {sum(row)}, expected {ctx + i + 1}")
        for i, (t, pos) in enumerate(zip(tokens, positions, strict=True)):
            page, off = pages[(ctx + i) // ps], (ctx + i) % ps
            if page not in kv.owned:
                raise _trap("forward", f"page {page} is read-only (imported)")
            kv.slots[page][off] = (t, pos)
        seq = [kv.slots[pages[j // ps]][j % ps] for j in range(total)]
        if None in seq:
            raise _trap("forward", f"slot {seq.index(None)} of the sequence was never written")
        result = []
        for spec in outputs:
            if not 0 <= spec.index < len(tokens):
                raise _trap("forward", f"output index {spec.index} out of 0..{len(tokens) - 1}")
            visible = self._visible(seq[: ctx + spec.index + 1], mask[spec.index] if mask else None)
            token = _next_token(visible) if not (self.script and spec.sample) else self.script.pop(0)
            ids = [(token + k) % VOCAB for k in range(spec.dist)]
            probs = [0.5 / (k + 1) for k in range(spec.dist)]
            result.append(WitOutput(token if spec.sample is not None else None, ids, probs))
        return result

    @staticmethod
    def _visible(seq: list[Any], row: list[int] | None) -> list[Any]:
        if row is None:
            return seq
        out, j = [], 0
        for r, n in enumerate(row):
            if r % 2 == 0:
                out.extend(seq[j : j + n])
            j += n
        return out

    def decode_step(self, pages, last_page_len, token, position, sampler) -> int:  # noqa: ANN001
        self.decode_step_calls += 1
        out = self.run(pages, last_page_len, [token], [position], [], [WitOutputSpec(0, sampler, 0)])
        assert out[0].token is not None
        return out[0].token

    def submit(self, *args: Any) -> int:
        h = self.next_handle
        self.next_handle += 1
        self.results[h] = self.run(*args)
        return h

    def wait(self, handle: int) -> list[WitOutput]:
        if handle not in self.results:
            raise _trap("forward.wait", f"unknown handle {handle}")
        return self.results.pop(handle)

    def wait_any(self, handles: list[int]) -> tuple[int, list[WitOutput]]:
        h = max(handles)  # the newest: callers must not rely on submission order
        return h, self.wait(h)


def _next_token(visible: list[Any]) -> int:
    """The fake model: a byte token determined by everything the row attends to."""
    acc = 7
    for tok, pos in visible:
        acc = (acc * 31 + tok * 7 + pos) % 1_000_003
    return _OFFSET + ord("a") + acc % 26


class FakeHost:
    """All six host interfaces, faked in memory. `install()` binds them into the SDK."""

    def __init__(self, page_size: int = 4, num_pages: int = 64, args: list[str] | None = None,
                 max_pages: int | None = None) -> None:  # fmt: skip
        self.runtime = _Runtime(args or [])
        self.messaging = _Messaging()
        self.store = _Store()
        self.model = _Model()
        self.kv = _Kv(page_size, num_pages, max_pages)
        self.forward = _Forward(self.kv)

    def install(self) -> FakeHost:
        """Bind this host into the SDK and forget the SDK's cached host state."""
        from inferlet.model import get_model
        from inferlet.pages import PAGES

        _host.bind(runtime=self.runtime, messaging=self.messaging, store=self.store,
                   model=self.model, kv=self.kv, forward=self.forward)  # fmt: skip
        PAGES.reset()
        get_model()._reset()
        return self
