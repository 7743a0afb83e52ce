"""WIT interface `embed` (0.5.0): embedding slots, passes that take them, and hidden-state passes.

A slot is a run of float32 vectors of the model's hidden size, held in host memory for the instance
that made it (`Slots`: per instance, bounded by a count and bytes, like pages by a quota; freed
when released or when the instance ends). `embed-image` runs the model's vision tower on the
scheduler's thread between batches (`Scheduler.call_soon`: the backend is that thread's), the
instance waiting without its run-gate slot; `embed-text` reads the embedding table there too (an
engine process answers both itself: gpu_backend/engine/client.py).
`run` and `hidden` are `forward.run` with `ForwardRequest.embeds` made from the slots: checked and
queued as any pass (host/api/passes.py), never cached by the prefix cache (their token ids are
placeholders), never split by chunked prefill.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from gpu_backend.types import BackendInfo, ForwardRequest, OutputResult, OutputSpec
from host.api.guest import GuestError, Import, guest_import
from host.api.passes import Passes, outputs_of
from host.replicas import Replica
from host.wasm.instance import Instance

__all__ = ["SlotLimits", "Slots", "imports"]

# a backend with neither `input_embeddings` / `embed_image` nor a vision tower (the torch backend, the
# stand-in and an engine process (gpu_backend/engine/client.py) have them)
_NOT_HERE = "this host's backend gives no embeddings (it has no input_embeddings / embed_image)"
MAX_IMAGE_BYTES = 20 << 20  # an image's encoded bytes (the OpenAI routes bound them first: --max-image-mb)


@dataclass(frozen=True)
class SlotLimits:
    """What one instance's slots may hold at once (HostConfig.max_embedding_slots / _bytes)."""

    max_slots: int = 256
    max_bytes: int = 256 << 20


class Slots:
    """Every instance's embedding slots: handle -> float32 bytes."""

    def __init__(self, hidden: int, limits: SlotLimits | None = None) -> None:
        self.hidden = hidden
        self.limits = limits or SlotLimits()
        self._lock = threading.Lock()
        self._by_inst: dict[str, dict[int, bytes]] = {}
        self._next: dict[str, int] = {}

    def add(self, inst: Instance, data: bytes) -> int | str:
        """A new slot of `data` for `inst`: its handle, or why not (its limits)."""
        with self._lock:
            mine = self._by_inst.setdefault(inst.id, {})
            if len(mine) >= self.limits.max_slots:
                return (f"the instance holds its maximum of {self.limits.max_slots} embedding slots "
                        "(--max-embedding-slots): release some")
            held = sum(len(d) for d in mine.values())
            if held + len(data) > self.limits.max_bytes:
                return (f"the instance's embedding slots would hold {held + len(data)} bytes, over its "
                        f"{self.limits.max_bytes} (--max-embedding-mb): release some")
            h = self._next[inst.id] = self._next.get(inst.id, 0) + 1
            mine[h] = data
            return h

    def get(self, inst: Instance, slot: int) -> bytes:
        with self._lock:
            data = self._by_inst.get(inst.id, {}).get(slot)
        if data is None:
            raise GuestError(f"unknown embedding slot {slot} (never made by this instance, or released)")
        return data

    def release(self, inst: Instance, slots: Sequence[int]) -> None:
        with self._lock:
            mine = self._by_inst.get(inst.id, {})
            missing = [s for s in slots if s not in mine]
            if missing:
                raise GuestError(f"unknown embedding slot {missing[0]} (never made by this instance, or released)")
            for s in slots:
                del mine[s]

    def drop(self, inst: Instance) -> None:
        """The instance ended: its slots go."""
        with self._lock:
            self._by_inst.pop(inst.id, None)
            self._next.pop(inst.id, None)

    def held(self, inst: Instance) -> int:
        with self._lock:
            return len(self._by_inst.get(inst.id, {}))


def imports(replicas: Sequence[Replica], info: BackendInfo, slots: Slots) -> dict[str, Import]:
    passes = Passes(replicas, info)
    hidden_size = int(getattr(info, "hidden_size", 0) or 0)
    image_tokens = int(getattr(info, "image_tokens", 0) or 0)
    image_token = getattr(info, "image_token_id", None)

    def on_backend(inst: Instance, fn: Callable[[Any], Any]) -> Any:
        """`fn(backend)` on the instance's scheduler thread, waited for without the run-gate slot."""
        sched = passes.scheduler(inst)
        fut = sched.call_soon(lambda: fn(sched.backend))
        fut.add_done_callback(lambda _f: inst.wake())
        inst.wait_until(fut.done)
        return fut.result()

    def embeds_of(inst: Instance, pairs: list[tuple[int, int]], n: int) -> list[tuple[int, bytes]] | None:
        out = []
        for index, slot in pairs:
            data = slots.get(inst, slot)
            count = len(data) // (4 * hidden_size)
            if index + count > n:
                raise GuestError(f"embedding slot {slot} ({count} vectors) at token {index} passes the pass's "
                                 f"{n} tokens")
            out.append((index, data))
        return out or None

    @guest_import("embed.hidden-size", before_launch=True)
    def get_hidden_size(inst: Instance) -> int:
        return hidden_size

    @guest_import("embed.image-tokens", before_launch=True)
    def get_image_tokens(inst: Instance) -> int:
        return image_tokens

    @guest_import("embed.image-token-id", before_launch=True)
    def get_image_token_id(inst: Instance) -> int | None:
        return image_token

    @guest_import("embed.embed-image")
    def embed_image(inst: Instance, image_b64: str, media_type: str) -> int | str:
        inst.check_alive()
        if not image_tokens:
            return "this model has no vision tower: it takes no images"
        if len(image_b64) > MAX_IMAGE_BYTES * 4 // 3 + 4:
            return f"the image is over the host's {MAX_IMAGE_BYTES} bytes"
        try:
            image = base64.b64decode(image_b64, validate=True)
        except (binascii.Error, ValueError):
            return "the image is not valid base64"
        if len(image) > MAX_IMAGE_BYTES:
            return f"the image is {len(image)} bytes, over the host's {MAX_IMAGE_BYTES}"

        def run(backend: Any) -> bytes:
            own = getattr(backend, "embed_image", None)
            if own is not None:
                return bytes(own(bytes(image), media_type))
            if not hasattr(backend, "vision"):
                raise ValueError(_NOT_HERE)
            from gpu_backend.images import embed_image as tower  # (the torch backend's vision tower)

            return np.ascontiguousarray(tower(backend, bytes(image), media_type), dtype="<f4").tobytes()

        try:
            data = on_backend(inst, run)
        except ValueError as e:  # it does not decode, is too large, ... (the image's fault: an error result)
            return str(e)
        return slots.add(inst, data)

    @guest_import("embed.embed-text")
    def embed_text(inst: Instance, tokens: list[int]) -> int | str:
        inst.check_alive()
        if not tokens:
            raise GuestError("embed-text of no tokens")
        for t in tokens:
            if t >= info.vocab_size:
                raise GuestError(f"token {t} is outside the vocabulary (size {info.vocab_size})")
        def run(backend: Any) -> bytes:
            if not hasattr(backend, "input_embeddings"):
                raise ValueError(_NOT_HERE)
            return bytes(backend.input_embeddings(tokens))

        try:
            data = on_backend(inst, run)
        except ValueError as e:
            return str(e)
        return slots.add(inst, data)

    @guest_import("embed.slot-len")
    def slot_len(inst: Instance, slot: int) -> int:
        return len(slots.get(inst, slot)) // (4 * hidden_size)

    @guest_import("embed.release")
    def release(inst: Instance, handles: list[int]) -> None:
        slots.release(inst, handles)

    def submit(inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
               pairs: list[tuple[int, int]], specs: list[OutputSpec]) -> list[OutputResult]:
        embeds = embeds_of(inst, pairs, len(tokens))
        with passes.gate(inst):
            req = passes.admit(inst, ForwardRequest(pages=pages, last_page_len=last_len, tokens=tokens,
                                                    positions=positions, outputs=specs, name=inst.label,
                                                    embeds=embeds))
            handle = inst.new_handle(passes.scheduler(inst).submit(req, inst.id))
        return passes.take(inst, handle)

    @guest_import("embed.run")
    def run_pass(inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
                 pairs: list[tuple[int, int]], outputs: list[Any]) -> list[OutputResult]:
        return submit(inst, pages, last_len, tokens, positions, pairs, outputs_of(outputs))

    @guest_import("embed.hidden")
    def hidden(inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
               pairs: list[tuple[int, int]], pooling: Any, normalize: bool) -> list[float]:
        if not tokens:
            raise GuestError("a pass of no tokens")
        mode = getattr(pooling, "name", pooling)  # (wasmtime-py gives an enum case as its name)
        rows = [len(tokens) - 1] if mode == "last" else range(len(tokens))
        res = submit(inst, pages, last_len, tokens, positions, pairs, [OutputSpec(index=i, hidden=True) for i in rows])
        vecs = np.stack([np.frombuffer(r.hidden or b"", dtype="<f4") for r in res])
        v = vecs.mean(axis=0) if mode == "mean" else vecs[-1]
        if normalize:
            norm = float(np.linalg.norm(v))
            v = v / norm if norm > 0 else v
        return [float(x) for x in v]

    return {"hidden-size": get_hidden_size, "image-tokens": get_image_tokens, "image-token-id": get_image_token_id,
            "embed-image": embed_image, "embed-text": embed_text, "slot-len": slot_len, "release": release,
            "run": run_pass, "hidden": hidden}
