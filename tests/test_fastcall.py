"""host/api/fastcall.py's list<u32> conversions against wasmtime-py's own (the reference)."""

from __future__ import annotations

import ctypes

import pytest
from wasmtime import _ffi as ffi
from wasmtime.component import _types as T

from host.api import fastcall


def _u32_list_type() -> T.ListType:
    """A list<u32> type object as the linker would hand it to a conversion (element memoized)."""
    lt = T.ListType.__new__(T.ListType)
    lt.__dict__["element"] = T.U32.__new__(T.U32)
    return lt


def _elements(val: ffi.wasmtime_component_val_t) -> list[tuple[int, int]]:
    """(kind, u32) of each element of a converted list."""
    assert val.kind == ffi.WASMTIME_COMPONENT_LIST.value
    raw = val.of.list
    return [(raw.data[i].kind, raw.data[i].of.u32) for i in range(raw.size)]


@pytest.mark.parametrize("values", [[0], [1, 2, 3], list(range(1000)), [2**32 - 1, 7, 0]])
def test_list_u32_to_c_matches_wasmtime_py(values: list[int]) -> None:
    fastcall._patch_types()
    lt = _u32_list_type()
    fast, ref = ffi.wasmtime_component_val_t(), ffi.wasmtime_component_val_t()
    fastcall._list_to_c(lt, None, list(values), ctypes.pointer(fast))
    fastcall._LIST_TO_C(lt, None, list(values), ctypes.pointer(ref))
    try:
        assert _elements(fast) == _elements(ref) == [(ffi.WASMTIME_COMPONENT_U32.value, v) for v in values]
        assert fastcall._list_from_c(lt, fast) == values  # and back (this frees the list)
    finally:
        ffi.wasmtime_component_vallist_delete(ctypes.byref(ref.of.list))


def test_list_to_c_falls_back_for_what_it_does_not_handle() -> None:
    fastcall._patch_types()
    lt = _u32_list_type()
    with pytest.raises(TypeError, match="expected int"):  # wasmtime-py's own error for a non-int element
        fastcall._list_to_c(lt, None, [1, "x"], ctypes.pointer(ffi.wasmtime_component_val_t()))
    empty = ffi.wasmtime_component_val_t()
    fastcall._list_to_c(lt, None, [], ctypes.pointer(empty))
    assert empty.of.list.size == 0
