"""The WIT imports of world `pie:inferlet/inferlet@0.1.0`, implemented for wasmtime.

One linker serves every instance: each import finds its caller through a thread-local
(each instance runs on its own thread). Guest *bugs* trap the instance with a message
naming the call and the bad value; *conditions* come back as the WIT `result` error.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import wasmtime
from wasmtime.component import Linker

from gpu_backend.types import ForwardRequest, OutputResult, OutputSpec, SamplerParams
from gpu_backend.validate import as_sampler
from host.fastcall import add_func
from host.instance import Instance, Terminated
from host.kv import PageError

if TYPE_CHECKING:
    from host.runtime import Host

log = logging.getLogger(__name__)

PACKAGE = "pie:inferlet"
WIT_VERSION = "0.1.0"
U32_MAX = 2**32 - 1

_current = threading.local()


def current() -> Instance:
    inst: Instance | None = getattr(_current, "instance", None)
    if inst is None:
        raise wasmtime.WasmtimeError("host import called outside an inferlet thread")
    return inst


def bind(inst: Instance | None) -> None:
    _current.instance = inst


class GuestError(Exception):
    """Guest misuse of an import: traps the instance with this message."""


def _import(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap an import: turn guest misuse into a trap with a clear reason, never a host crash."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(_store: Any, *args: Any) -> Any:
            inst = current()
            try:
                return fn(inst, *args)
            except Terminated as e:
                raise wasmtime.WasmtimeError(f"instance terminated: {e}") from None
            except (GuestError, PageError, ValueError, TypeError, OverflowError) as e:
                inst.trap_reason = f"{name}: {e}"
                raise wasmtime.WasmtimeError(inst.trap_reason) from None
            except wasmtime.WasmtimeError:
                raise
            except Exception as e:  # a host bug: trap this guest with the reason, keep serving
                log.exception("host import %s failed", name)
                inst.trap_reason = f"{name}: internal host error: {type(e).__name__}: {e}"
                raise wasmtime.WasmtimeError(inst.trap_reason) from None

        return wrapper

    return deco


def _u32_list(values: list[int], what: str) -> list[int]:
    for v in values:
        if v < 0 or v > U32_MAX:
            raise GuestError(f"{what} value {v} is not a u32")
    return values


def _sampler(rec: Any) -> SamplerParams:
    return SamplerParams(temperature=rec.temperature, top_k=getattr(rec, "top-k"), top_p=getattr(rec, "top-p"),
                         min_p=getattr(rec, "min-p"), seed=rec.seed)


def _outputs(specs: list[Any]) -> list[OutputSpec]:
    return [OutputSpec(index=s.index, sample=None if s.sample is None else _sampler(s.sample), dist=s.dist)
            for s in specs]


def build_linker(host: Host) -> Linker:
    """A linker with WASI p2 and every import of our world, bound to `host`."""
    linker = Linker(host.wasm.engine)
    linker.add_wasip2()
    funcs = _functions(host)
    with linker.root() as root:
        for iface, table in funcs.items():
            with root.add_instance(f"{PACKAGE}/{iface}@{WIT_VERSION}") as li:
                for fname, fn in table.items():
                    add_func(li, fname, fn)
    return linker


def _functions(host: Host) -> dict[str, dict[str, Callable[..., Any]]]:
    backend = host.backend
    tok = backend.tokenizer
    info = backend.info
    pm = host.pages
    page_size = info.page_size
    vocab, max_position = info.vocab_size, info.max_position or U32_MAX + 1  # 0: not known

    # ---- runtime ----
    @_import("runtime.version")
    def version(inst: Instance) -> str:
        return WIT_VERSION

    @_import("runtime.instance-id")
    def instance_id(inst: Instance) -> str:
        return inst.id

    @_import("runtime.arguments")
    def arguments(inst: Instance) -> list[str]:
        return inst.args

    @_import("runtime.set-return")
    def set_return(inst: Instance, value: str) -> None:
        inst.return_value = value

    @_import("runtime.log")
    def log_line(inst: Instance, message: str) -> None:
        log.debug("[%s] %s", inst.id[:8], message)

    @_import("runtime.elapsed-ms")
    def elapsed_ms(inst: Instance) -> int:
        return inst.elapsed_ms()

    # ---- messaging ----
    @_import("messaging.send")
    def send(inst: Instance, message: str) -> None:
        inst.check_alive()
        inst.emit("message", message)

    @_import("messaging.receive")
    def receive(inst: Instance, timeout_ms: int | None) -> str | None:
        timeout = None if timeout_ms is None else timeout_ms / 1000
        if not inst.wait_until(lambda: bool(inst.inbox) or inst.input_closed, timeout):
            return None
        with inst.cond:
            return inst.inbox.popleft() if inst.inbox else None

    @_import("messaging.publish")
    def publish(inst: Instance, topic: str, message: str) -> None:
        host.publish(topic, message)

    @_import("messaging.subscribe")
    def subscribe(inst: Instance, topic: str) -> None:
        host.subscribe(inst, topic)

    @_import("messaging.unsubscribe")
    def unsubscribe(inst: Instance, topic: str) -> None:
        host.unsubscribe(inst, topic)

    @_import("messaging.receive-published")
    def receive_published(inst: Instance, timeout_ms: int | None) -> tuple[str, str] | None:
        timeout = None if timeout_ms is None else timeout_ms / 1000
        if not inst.wait_until(lambda: bool(inst.published), timeout):
            return None
        with inst.cond:
            return inst.published.popleft()

    # ---- store ----
    kvs = host.kvstore

    @_import("store.get")
    def store_get(inst: Instance, key: str) -> str | None:
        return kvs.get(key)

    @_import("store.set")
    def store_set(inst: Instance, key: str, value: str) -> None:
        kvs.set(key, value)

    @_import("store.delete")
    def store_delete(inst: Instance, key: str) -> None:
        kvs.delete(key)

    @_import("store.exists")
    def store_exists(inst: Instance, key: str) -> bool:
        return kvs.get(key) is not None

    @_import("store.list-keys")
    def store_list(inst: Instance) -> list[str]:
        return kvs.keys()

    # ---- model ----
    @_import("model.available-models")
    def available_models(inst: Instance) -> list[str]:
        return [info.name]

    @_import("model.load-model")
    def load_model(inst: Instance, name: str) -> str | None:
        if name != info.name:
            return f"unknown model {name!r}; available: {info.name}"
        return None

    @_import("model.model-name")
    def model_name(inst: Instance) -> str:
        return info.name

    @_import("model.vocab-size")
    def vocab_size(inst: Instance) -> int:
        return info.vocab_size

    @_import("model.stop-tokens")
    def stop_tokens(inst: Instance) -> list[int]:
        return list(info.stop_tokens)

    @_import("model.chat-template")
    def chat_template(inst: Instance) -> str:
        return info.chat_template

    @_import("model.apply-chat-template")
    def apply_chat_template(inst: Instance, messages: list[Any], add_generation_prompt: bool) -> str:
        msgs = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt)
        except Exception as e:  # template errors (e.g. raise_exception in the template) are guest input errors
            raise GuestError(f"chat template failed: {e}") from None

    @_import("model.encode")
    def encode(inst: Instance, text: str) -> list[int]:
        return tok.encode(text)

    @_import("model.decode")
    def decode(inst: Instance, tokens: list[int]) -> str:
        vocab = info.vocab_size
        for t in tokens:
            if t >= vocab:
                raise GuestError(f"token id {t} is outside the vocabulary (size {vocab})")
        return tok.decode(tokens)

    # ---- kv ----
    @_import("kv.page-size")
    def kv_page_size(inst: Instance) -> int:
        return page_size

    @_import("kv.free-pages")
    def kv_free(inst: Instance) -> int:
        return pm.free_count

    @_import("kv.allocate")
    def kv_allocate(inst: Instance, count: int) -> list[int] | str:
        inst.check_alive()
        return pm.allocate(inst.pages, count)

    @_import("kv.release")
    def kv_release(inst: Instance, pages: list[int]) -> None:
        pm.release(inst.pages, pages)

    @_import("kv.export-pages")
    def kv_export(inst: Instance, name: str, pages: list[int], persistent: bool) -> str | None:
        return pm.export(inst.pages, name, pages, persistent)

    @_import("kv.import-pages")
    def kv_import(inst: Instance, name: str) -> list[int] | str:
        return pm.import_(inst.pages, name)

    @_import("kv.unexport")
    def kv_unexport(inst: Instance, name: str) -> str | None:
        return pm.unexport(name)

    @_import("kv.list-exports")
    def kv_list_exports(inst: Instance) -> list[tuple[str, int]]:
        return pm.list_exports()

    @_import("kv.copy-tokens")
    def kv_copy(inst: Instance, src_page: int, src_off: int, dst_page: int, dst_off: int, count: int) -> None:
        pm.check_pages(inst.pages, [src_page], writable_from=1)
        pm.check_writable(inst.pages, dst_page)
        if src_off + count > page_size or dst_off + count > page_size:
            raise GuestError(f"copy of {count} tokens at offsets {src_off}/{dst_off} runs past the page size {page_size}")
        host.gate.leave()  # the backend serializes the copy with forwards: this may wait a whole batch
        try:
            backend.copy_tokens(src_page, src_off, dst_page, dst_off, count)
        finally:
            host.gate.enter()

    # ---- forward ----
    def _check_pass(inst: Instance, pages: list[int], last_len: int, n_tokens: int) -> None:
        """The page list of a pass: held by the instance, long enough, written pages writable."""
        inst.check_alive()
        if not pages:
            raise GuestError("empty page list")
        if not 1 <= last_len <= page_size:
            raise GuestError(f"last-page-len {last_len} is outside 1..{page_size}")
        total = (len(pages) - 1) * page_size + last_len
        if n_tokens > total:
            raise GuestError(f"{n_tokens} new tokens do not fit: the {len(pages)} pages with "
                             f"last-page-len {last_len} hold {total} tokens")
        pm.check_pages(inst.pages, pages, writable_from=(total - n_tokens) // page_size)

    def _submit(inst: Instance, pages: list[int], last_len: int, tokens: list[int], positions: list[int],
                mask: list[list[int]], outputs: list[Any]) -> int:
        _check_pass(inst, pages, last_len, len(tokens))
        req = ForwardRequest(pages=pages, last_page_len=last_len, tokens=_u32_list(tokens, "token"),
                             positions=positions, mask=mask or None, outputs=_outputs(outputs),
                             name=inst.label)
        backend.check_request(req)
        return inst.new_handle(host.scheduler.submit(req, inst.id))

    def _take(inst: Instance, handle: int) -> list[OutputResult]:
        fut = inst.forwards.get(handle)
        if fut is None:
            raise GuestError(f"unknown forward handle {handle} (never submitted or already waited on)")
        inst.wait_until(fut.done)
        del inst.forwards[handle]
        return fut.wait()

    @_import("forward.submit")
    def fwd_submit(inst: Instance, *args: Any) -> int:
        return _submit(inst, *args)

    @_import("forward.wait")
    def fwd_wait(inst: Instance, handle: int) -> list[OutputResult]:
        return _take(inst, handle)

    @_import("forward.wait-any")
    def fwd_wait_any(inst: Instance, handles: list[int]) -> tuple[int, list[OutputResult]]:
        if not handles:
            raise GuestError("wait-any on an empty handle list")
        futs = []
        for h in handles:
            fut = inst.forwards.get(h)
            if fut is None:
                raise GuestError(f"unknown forward handle {h} (never submitted or already waited on)")
            futs.append((h, fut))
        found: list[int] = []

        def any_done() -> bool:
            for h, f in futs:
                if f.done():
                    found.append(h)
                    return True
            return False

        inst.wait_until(any_done)
        return found[0], _take(inst, found[0])

    @_import("forward.run")
    def fwd_run(inst: Instance, *args: Any) -> list[OutputResult]:
        return _take(inst, _submit(inst, *args))

    decode_specs: dict[tuple[Any, ...], list[OutputSpec]] = {}  # sampler fields -> [OutputSpec]

    @_import("forward.decode-step")
    def fwd_decode_step(inst: Instance, pages: list[int], last_len: int, token: int, position: int,
                        sampler: Any) -> int:
        # forward.run(pages, last_len, [token], [position], [], [sample-only spec at 0]), minus
        # the general path's per-call objects: this is the call made once per generated token.
        # Checked here rather than by backend.check_request: everything the backend would reject
        # (a bad request fails its whole batch), for this fixed shape.
        _check_pass(inst, pages, last_len, 1)
        if token >= vocab:
            raise GuestError(f"token {token} is outside the vocabulary (size {vocab})")
        if position >= max_position:
            raise GuestError(f"position {position} is past the model's maximum {max_position - 1}")
        if len(set(pages)) != len(pages):
            raise GuestError(f"the page list repeats a page: {pages}")
        key = tuple(sampler.__dict__.values())
        outputs = decode_specs.get(key)
        if outputs is None:
            outputs = [OutputSpec(index=0, sample=as_sampler(_sampler(sampler), "sampler"))]
            if len(decode_specs) < 1024:
                decode_specs[key] = outputs
        req = ForwardRequest(pages=pages, last_page_len=last_len, tokens=[token], positions=[position],
                             outputs=outputs, name=inst.label)
        fut = host.scheduler.submit(req, inst.id)
        fut.add_done_callback(inst.wake)
        inst.wait_until(fut.done)
        out = fut.wait()[0].token
        assert out is not None  # the spec asked for a sampled token
        return out

    return {
        "runtime": {"version": version, "instance-id": instance_id, "arguments": arguments,
                    "set-return": set_return, "log": log_line, "elapsed-ms": elapsed_ms},
        "messaging": {"send": send, "receive": receive, "publish": publish, "subscribe": subscribe,
                      "unsubscribe": unsubscribe, "receive-published": receive_published},
        "store": {"get": store_get, "set": store_set, "delete": store_delete, "exists": store_exists,
                  "list-keys": store_list},
        "model": {"available-models": available_models, "load-model": load_model, "model-name": model_name,
                  "vocab-size": vocab_size, "stop-tokens": stop_tokens, "chat-template": chat_template,
                  "apply-chat-template": apply_chat_template, "encode": encode, "decode": decode},
        "kv": {"page-size": kv_page_size, "free-pages": kv_free, "allocate": kv_allocate, "release": kv_release,
               "export-pages": kv_export, "import-pages": kv_import, "unexport": kv_unexport,
               "list-exports": kv_list_exports, "copy-tokens": kv_copy},
        "forward": {"submit": fwd_submit, "wait": fwd_wait, "wait-any": fwd_wait_any, "run": fwd_run,
                    "decode-step": fwd_decode_step},
    }
