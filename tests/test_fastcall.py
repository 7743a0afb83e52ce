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


def _record_type(fields: list[tuple[str, object]]) -> T.RecordType:
    """A record type object as the linker would hand it to a conversion (fields memoized)."""
    rt = T.RecordType.__new__(T.RecordType)
    rt.__dict__["fields"] = fields
    return rt


def _option(payload: object) -> T.OptionType:
    ot = T.OptionType.__new__(T.OptionType)
    ot.__dict__["payload"] = payload
    return ot


def _sampler_type() -> T.RecordType:
    """The WIT `sampler` record's shape: f32, u32, f32, f32, option<u64>."""
    return _record_type([("temperature", T.F32()), ("top-k", T.U32()), ("top-p", T.F32()),
                         ("min-p", T.F32()), ("seed", _option(T.U64()))])


def _to_c(rt: T.RecordType, values: dict[str, object]) -> ffi.wasmtime_component_val_t:
    rec = T.Record()
    rec.__dict__.update(values)
    val = ffi.wasmtime_component_val_t()
    rt.convert_to_c(None, rec, ctypes.pointer(val))
    return val


@pytest.mark.parametrize("values", [
    {"temperature": 0.0, "top-k": 0, "top-p": 1.0, "min-p": 0.0, "seed": None},
    {"temperature": 0.7, "top-k": 2**32 - 1, "top-p": 0.9, "min-p": 0.05, "seed": None},
    {"temperature": 1.5, "top-k": 40, "top-p": 0.5, "min-p": 0.0, "seed": 2**64 - 1},  # some(..): general path
    {"temperature": 1.0, "top-k": 1, "top-p": 1.0, "min-p": 0.0, "seed": 0},
])
def test_record_from_c_matches_wasmtime_py(values: dict[str, object]) -> None:
    fastcall._patch_types()
    rt = _sampler_type()
    fast = fastcall._record_from_c(rt, _to_c(rt, values))  # frees the record
    ref = fastcall._RECORD_FROM_C(rt, _to_c(rt, values))
    assert fast.__dict__ == ref.__dict__
    assert list(fast.__dict__) == list(rt.fields[i][0] for i in range(5))
    assert fast.__dict__["top-k"] == values["top-k"] and fast.__dict__["seed"] == values["seed"]


def test_record_from_c_reads_every_scalar_kind() -> None:
    fastcall._patch_types()
    fields: list[tuple[str, object]] = [
        ("b", T.Bool()), ("s8", T.S8()), ("u8", T.U8()), ("s16", T.S16()), ("u16", T.U16()), ("s32", T.S32()),
        ("u32", T.U32()), ("s64", T.S64()), ("u64", T.U64()), ("f32", T.F32()), ("f64", T.F64())]
    rt = _record_type(fields)
    values = {"b": True, "s8": -128, "u8": 255, "s16": -32768, "u16": 65535, "s32": -2**31, "u32": 2**32 - 1,
              "s64": -2**63, "u64": 2**64 - 1, "f32": 0.5, "f64": -1e300}
    assert fastcall._FlatRecord.plan(fields) is not None  # read in one unpack, not field by field
    assert fastcall._record_from_c(rt, _to_c(rt, values)).__dict__ == values
    mixed = _record_type([("n", T.U32()), ("name", T.String())])  # a string field: the general path
    assert fastcall._FlatRecord.plan(mixed.fields) is None
    assert fastcall._record_from_c(mixed, _to_c(mixed, {"n": 3, "name": "x"})).__dict__ == {"n": 3, "name": "x"}


@pytest.mark.parametrize("text", ["", "a", "finish", "héllo wörld ✓ 你好", "nul\x00inside", "long " * 2000])
def test_byte_vectors_match_wasmtime_py(text: str) -> None:
    """Strings, enum cases and field names cross as C byte vectors: the replacements make the same
    vectors as wasmtime-py's `str_to_capi` / `bytes_to_capi` and read them back as its `to_str` does."""
    fastcall._patch_types()
    ref_bytes, ref_str, ref_to_bytes, ref_to_str = fastcall._BYTE_VECS
    assert ffi.str_to_capi is not ref_str  # patched
    data = text.encode()
    for fast, ref in [(ffi.str_to_capi(text), ref_str(text)), (ffi.bytes_to_capi(data), ref_bytes(data)),
                      (ffi.bytes_to_capi(bytearray(data)), ref_bytes(bytearray(data)))]:
        try:
            assert fast.size == ref.size == len(data)
            assert ctypes.string_at(fast.data, fast.size) == ctypes.string_at(ref.data, ref.size) == data
            assert ffi.to_str(fast) == text and ffi.to_bytes(fast) == bytearray(data)
            assert ref_to_str(fast) == text and ref_to_bytes(fast) == bytearray(data)
        finally:
            ffi.wasm_byte_vec_delete(ctypes.byref(fast))
            ffi.wasm_byte_vec_delete(ctypes.byref(ref))


def test_byte_vectors_refuse_what_wasmtime_py_refuses() -> None:
    fastcall._patch_types()
    with pytest.raises(TypeError, match="expected a string"):
        ffi.str_to_capi(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="expected bytes or bytearray"):
        ffi.bytes_to_capi("text")  # type: ignore[arg-type]
