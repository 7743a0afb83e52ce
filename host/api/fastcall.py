"""A faster host-function path for wasmtime-py's component linker.

wasmtime-py re-reads a host function's type through the C API on every call, and each list
element / record field conversion asks again for its element or field types: about 40 FFI
type lookups for one `forward.run` call (~230 us of a ~250 us round trip, measured with
bench/inferlets/hostcalls). The types of an import never change, so this module

- memoizes the type accessors (`ListType.element`, `RecordType.fields`, ...) per type object, and
- registers host functions through a callback that builds their parameter/result types once.

Values are converted by wasmtime-py's own code, except for lists and records, which every start
and end of an inferlet passes: host/api/values.py has their faster versions. bench/conversions.py
compares the costs, and `wasmtime_py_values` restores wasmtime-py's way. A host exception is kept
per thread (`catch_exceptions`), and a call can be tapped for recording (`set_tap`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from wasmtime import StoreContext, WasmtimeError
from wasmtime import _ffi as ffi
from wasmtime.component import _enter
from wasmtime.component import _linker as L
from wasmtime.component import _types as T

from host.api import values
from host.wasm.calling import calling

__all__ = ["add_func", "set_tap"]


def _memo_property(cls: type, name: str) -> None:
    fget = getattr(cls, name).fget

    @functools.wraps(fget)
    def get(self: Any) -> Any:
        d = self.__dict__
        if name not in d:
            d[name] = fget(self)
        return d[name]

    setattr(cls, name, property(get))


def _memo_method(cls: type, name: str) -> None:
    fn = getattr(cls, name)
    key = f"_memo_{name}"

    @functools.wraps(fn)
    def call(self: Any) -> Any:
        d = self.__dict__
        if key not in d:
            d[key] = fn(self)
        return d[key]

    setattr(cls, name, call)


_PATCHED = False


def _patch_types() -> None:
    global _PATCHED
    if _PATCHED:
        return
    for cls, name in [(T.ListType, "element"), (T.RecordType, "fields"), (T.TupleType, "elements"),
                      (T.OptionType, "payload"), (T.ResultType, "ok"), (T.ResultType, "err"),
                      (T.VariantType, "cases"), (T.EnumType, "names"), (T.FlagsType, "names")]:
        _memo_property(cls, name)
    for cls in (T.VariantType, T.OptionType, T.ResultType):
        _memo_method(cls, "_cases")
    _memo_method(T.VariantLikeType, "_tagged")
    values.install()
    _enter.catch_exceptions = L.catch_exceptions = catch_exceptions  # type: ignore[assignment]
    _enter.maybe_raise_last_exn = _maybe_raise_last_exn  # (read by `_enter.enter_wasm`)
    _PATCHED = True


def catch_exceptions(store_raw: Any, func: Callable[[StoreContext], None]) -> int:
    """wasmtime-py's `catch_exceptions` (a host function's wrapper), with the Python exception kept
    for the thread that made the call, not in one global: the thread's `enter_wasm` re-raises it
    when the guest's call returns with the error. With the global, an instance whose guest trapped
    while another instance's import was failing took that one's exception as its own (a guest
    with invalid UTF-8 ended "aborted: terminated" next to an instance being terminated)."""
    store = StoreContext(store_raw)
    exception = None
    try:
        func(store)
    except WasmtimeError as e:
        exception = e
    except Exception as e:
        calling.exception = e
        exception = WasmtimeError("python exception")
    finally:
        store._invalidate()
    if exception:
        return ctypes.cast(exception._consume(), ctypes.c_void_p).value or 0
    return 0


def _maybe_raise_last_exn() -> None:
    """wasmtime-py's, reading this thread's exception (`catch_exceptions`)."""
    exception = getattr(calling, "exception", None)
    if exception is not None:
        calling.exception = None
        raise exception


_VALUE_PATCHES = [("ListType", "convert_from_c"), ("ListType", "convert_to_c"), ("RecordType", "convert_from_c"),
                  ("RecordType", "convert_to_c")]


@contextlib.contextmanager
def wasmtime_py_values() -> Iterator[None]:
    """While inside: lists and records convert the way wasmtime-py does, element by element (the
    type memos and byte-vector patches stay), for comparisons (bench/conversions.py, host_scale's
    `wasmtime_values` variant). Not for a host serving others: it changes the classes process-wide."""
    _patch_types()
    saved = [(getattr(T, c), n, getattr(T, c).__dict__[n]) for c, n in _VALUE_PATCHES]
    for cls, name, _fn in saved:
        setattr(cls, name, values.ORIGINALS[(cls.__name__, name)])
    try:
        yield
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)


_FUNCS: dict[int, Callable[..., Any]] = {}
_NAMES: dict[int, str] = {}  # each function's label ("interface.name"), for the tap
_SIGS: dict[int, tuple[list[Any], Any]] = {}
# The recording hook (host/replay/recorder.py): None unless some instance records its calls; then
# every call goes through `tap(label, func, store, args)`, which calls `func` and returns its result.
Tap = Callable[[str, Callable[..., Any], StoreContext, list[Any]], Any]
_tap: Tap | None = None
_keys = itertools.count(1)  # never 0: the key travels as a C void* and comes back as `idx or 0`


@L.CFUNCTYPE(None, L.c_void_p)
def _finalize(idx):  # type: ignore[no-untyped-def]
    _FUNCS.pop(idx or 0, None)
    _NAMES.pop(idx or 0, None)
    _SIGS.pop(idx or 0, None)


@ffi.wasmtime_component_func_callback_t
def _call(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
    key = idx or 0

    def run(store: StoreContext) -> None:
        sig = _SIGS.get(key)
        if sig is None:
            # The func type handle belongs to this call; the types read from it are owned copies.
            with T.FuncType._from_ptr(ty_raw, owner=store) as fty:
                sig = ([ty for _, ty in fty.params], fty.result)
            _SIGS[key] = sig
        param_tys, result_ty = sig
        pyargs = [ty.convert_from_c(args[i]) for i, ty in enumerate(param_tys[:nargs])]
        tap = _tap  # (a call of an instance that records nothing costs this read)
        result = _FUNCS[key](store, *pyargs) if tap is None else tap(_NAMES[key], _FUNCS[key], store, pyargs)
        if result_ty is not None:
            result_ty.convert_to_c(store, result, results)

    return catch_exceptions(context, run)


def add_func(linker_instance: L.LinkerInstance, name: str, func: Callable[..., Any], label: str | None = None) -> None:
    """Like `LinkerInstance.add_func`, with types resolved once and memoized conversions; `label`
    names the function to the tap (default `name`)."""
    _patch_types()
    linker_instance._assert_not_locked()
    idx = next(_keys)
    _FUNCS[idx] = func
    _NAMES[idx] = label or name
    name_bytes = name.encode("utf-8")
    err = ffi.wasmtime_component_linker_instance_add_func(
        linker_instance.ptr(), L.create_string_buffer(name_bytes), len(name_bytes), _call, idx, _finalize)
    if err:
        raise L.WasmtimeError._from_ptr(err)


def set_tap(tap: Tap | None) -> None:
    """Route every call through `tap` from now on (None: call the functions directly again)."""
    global _tap
    _tap = tap
