"""A faster host-function path for wasmtime-py's component linker.

wasmtime-py re-reads a host function's type through the C API on every call, and each list
element / record field conversion asks again for its element or field types: about 40 FFI
type lookups for one `forward.run` call (~230 us of a ~250 us round trip, measured with
bench/inferlets/hostcalls). The types of an import never change, so this module

- memoizes the type accessors (`ListType.element`, `RecordType.fields`, ...) per type object, and
- registers host functions through a callback that builds their parameter/result types once.

Values are converted by wasmtime-py's own code, so behaviour is unchanged.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

from wasmtime import StoreContext
from wasmtime import _ffi as ffi
from wasmtime.component import _linker as L
from wasmtime.component import _types as T
from wasmtime.component._enter import catch_exceptions

__all__ = ["add_func"]


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
    _PATCHED = True


_FUNCS: dict[int, Callable[..., Any]] = {}
_SIGS: dict[int, tuple[list[Any], Any]] = {}
_keys = itertools.count(1)  # never 0: the key travels as a C void* and comes back as `idx or 0`


@L.CFUNCTYPE(None, L.c_void_p)
def _finalize(idx):  # type: ignore[no-untyped-def]
    _FUNCS.pop(idx or 0, None)
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
        result = _FUNCS[key](store, *pyargs)
        if result_ty is not None:
            result_ty.convert_to_c(store, result, results)

    return catch_exceptions(context, run)


def add_func(linker_instance: L.LinkerInstance, name: str, func: Callable[..., Any]) -> None:
    """Like `LinkerInstance.add_func`, with types resolved once and memoized conversions."""
    _patch_types()
    linker_instance._assert_not_locked()
    idx = next(_keys)
    _FUNCS[idx] = func
    name_bytes = name.encode("utf-8")
    err = ffi.wasmtime_component_linker_instance_add_func(
        linker_instance.ptr(), L.create_string_buffer(name_bytes), len(name_bytes), _call, idx, _finalize)
    if err:
        raise L.WasmtimeError._from_ptr(err)
