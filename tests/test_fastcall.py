"""host/api/values.py's list and record conversions (installed by host/api/fastcall.py) against wasmtime-py's own (the reference)."""

from __future__ import annotations

import ctypes
import threading

import pytest
from wasmtime import _ffi as ffi
from wasmtime.component import _types as T

from host.api import fastcall
from host.api import values as conv


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


@pytest.mark.parametrize("values", [[0], [1, 2, 3], list(range(1000)), [2**32 - 1, 7, 0],
                                    [True, False, 7], [-1, 2**32, 2**32 + 5, 2**70 + 3]])
def test_list_u32_to_c_matches_wasmtime_py(values: list[int]) -> None:
    """Bools and ints out of range are stored as wasmtime-py's own conversion stores them (masked)."""
    fastcall._patch_types()
    lt = _u32_list_type()
    stored = [v & 0xFFFFFFFF for v in values]
    fast, ref = ffi.wasmtime_component_val_t(), ffi.wasmtime_component_val_t()
    conv._list_to_c(lt, None, list(values), ctypes.pointer(fast))
    conv._LIST_TO_C(lt, None, list(values), ctypes.pointer(ref))
    try:
        assert _elements(fast) == _elements(ref) == [(ffi.WASMTIME_COMPONENT_U32.value, v) for v in stored]
        assert conv._list_from_c(lt, fast) == stored  # and back (this frees the list)
    finally:
        ffi.wasmtime_component_vallist_delete(ctypes.byref(ref.of.list))


def test_list_to_c_falls_back_for_what_it_does_not_handle() -> None:
    fastcall._patch_types()
    lt = _u32_list_type()
    with pytest.raises(TypeError, match="expected int"):  # wasmtime-py's own error for a non-int element
        conv._list_to_c(lt, None, [1, "x"], ctypes.pointer(ffi.wasmtime_component_val_t()))
    empty = ffi.wasmtime_component_val_t()
    conv._list_to_c(lt, None, [], ctypes.pointer(empty))
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
    fast = conv._record_from_c(rt, _to_c(rt, values))  # frees the record
    ref = conv._RECORD_FROM_C(rt, _to_c(rt, values))
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
    assert conv._FlatRecord.plan(fields) is not None  # read in one unpack, not field by field
    assert conv._record_from_c(rt, _to_c(rt, values)).__dict__ == values
    nested = _record_type([("n", T.U32()), ("xs", _u32_list_type())])  # a list field: the general path
    assert conv._FlatRecord.plan(nested.fields) is None
    assert conv._record_from_c(nested, _to_c(nested, {"n": 3, "xs": [1, 2]})).__dict__ == {"n": 3, "xs": [1, 2]}


@pytest.mark.parametrize("text", ["", "a", "finish", "héllo wörld ✓ 你好", "nul\x00inside", "long " * 2000])
def test_byte_vectors_match_wasmtime_py(text: str) -> None:
    """Strings, enum cases and field names cross as C byte vectors: the replacements make the same
    vectors as wasmtime-py's `str_to_capi` / `bytes_to_capi` and read them back as its `to_str` does."""
    fastcall._patch_types()
    ref_bytes, ref_str, ref_to_bytes, ref_to_str = conv._BYTE_VECS
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


def _string_list_type() -> T.ListType:
    lt = T.ListType.__new__(T.ListType)
    lt.__dict__["element"] = T.String()
    return lt


_TEXTS = ["", "a", "héllo wörld ✓ 你好", "nul\x00inside", "long " * 500]


def test_list_u32_to_c_refuses_a_float_as_wasmtime_py_does() -> None:
    fastcall._patch_types()
    with pytest.raises(TypeError, match="expected int"):
        conv._list_to_c(_u32_list_type(), None, [1, 2.0], ctypes.pointer(ffi.wasmtime_component_val_t()))


@pytest.mark.parametrize("values", [[t] for t in _TEXTS] + [_TEXTS, ["--prompt", "x", "--max-tokens", "64"]])
def test_string_lists_match_wasmtime_py(values: list[str]) -> None:
    """list<string> both ways: the same vectors as wasmtime-py's element-wise conversion, read back
    by it and by the fast path (which also frees the list)."""
    fastcall._patch_types()
    lt = _string_list_type()
    fast, ref = ffi.wasmtime_component_val_t(), ffi.wasmtime_component_val_t()
    conv._list_to_c(lt, None, list(values), ctypes.pointer(fast))
    conv._LIST_TO_C(lt, None, list(values), ctypes.pointer(ref))
    raw_f, raw_r = fast.of.list, ref.of.list
    assert raw_f.size == raw_r.size == len(values)
    for i in range(len(values)):
        assert raw_f.data[i].kind == raw_r.data[i].kind == ffi.WASMTIME_COMPONENT_STRING.value
        f, r = raw_f.data[i].of.string, raw_r.data[i].of.string
        assert ctypes.string_at(f.data, f.size) == ctypes.string_at(r.data, r.size) == values[i].encode()
    assert conv._list_from_c(lt, fast) == values
    assert conv._LIST_FROM_C(lt, ref) == values


def test_string_list_to_c_refuses_what_wasmtime_py_refuses() -> None:
    fastcall._patch_types()
    lt = _string_list_type()
    with pytest.raises(TypeError, match="expected string"):
        conv._list_to_c(lt, None, ["a", b"b"], ctypes.pointer(ffi.wasmtime_component_val_t()))
    with pytest.raises(UnicodeEncodeError):
        conv._list_to_c(lt, None, ["a", "\ud800"], ctypes.pointer(ffi.wasmtime_component_val_t()))


def _enum_type(names: list[str]) -> T.EnumType:
    et = T.EnumType.__new__(T.EnumType)
    et.__dict__["names"] = names
    return et


def _generation_type() -> T.RecordType:
    """The WIT `generation` record's shape (forward.generate's result)."""
    return _record_type([("tokens", _u32_list_type()), ("new-pages", _u32_list_type()), ("trim", T.U32()),
                         ("finish", _enum_type(["length", "stop-token"]))])


def _record(values: dict[str, object]) -> T.Record:
    rec = T.Record()
    rec.__dict__.update(values)
    return rec


@pytest.mark.parametrize("values", [
    {"tokens": list(range(1000, 1064)), "new-pages": [5, 6], "trim": 0, "finish": "length"},
    {"tokens": [7], "new-pages": [], "trim": 1, "finish": "stop-token"},
])
def test_record_to_c_matches_wasmtime_py(values: dict[str, object]) -> None:
    """A record written in place: the same entries (names, kinds, values) as wasmtime-py's, read back
    the same way by wasmtime-py's own reader."""
    fastcall._patch_types()
    rt = _generation_type()
    fast, ref = ffi.wasmtime_component_val_t(), ffi.wasmtime_component_val_t()
    conv._record_to_c(rt, None, _record(values), ctypes.pointer(fast))
    conv._RECORD_TO_C(rt, None, _record(values), ctypes.pointer(ref))
    for i, name in enumerate(values):
        fe, re_ = fast.of.record.data[i], ref.of.record.data[i]
        assert ctypes.string_at(fe.name.data, fe.name.size) == ctypes.string_at(re_.name.data, re_.name.size) \
            == name.encode()
        assert fe.val.kind == re_.val.kind
    assert conv._RECORD_FROM_C(rt, fast).__dict__ == conv._RECORD_FROM_C(rt, ref).__dict__ == values


def test_record_to_c_cleans_up_after_a_bad_field() -> None:
    """A field that cannot be converted raises wasmtime-py's error; what was written is freed (no crash)."""
    fastcall._patch_types()
    rt = _generation_type()
    for bad in [{"tokens": [1, 2], "new-pages": [3], "trim": "x", "finish": "length"},
                {"tokens": [1, 2], "new-pages": [3], "trim": 0, "finish": 5},
                {"tokens": 1.5, "new-pages": [3], "trim": 0, "finish": "length"}]:
        with pytest.raises(TypeError):
            conv._record_to_c(rt, None, _record(bad), ctypes.pointer(ffi.wasmtime_component_val_t()))
    with pytest.raises(AttributeError):  # a missing field, as wasmtime-py's getattr
        conv._record_to_c(rt, None, _record({"tokens": [1]}), ctypes.pointer(ffi.wasmtime_component_val_t()))


@pytest.mark.parametrize("role, content", [("user", "What is the capital of France?"), ("", ""),
                                           ("system", "héllo ✓ 你好\x00" * 50)])
def test_record_of_strings_from_c_matches_wasmtime_py(role: str, content: str) -> None:
    """A chat message (record of strings, and a scalar) is read flat, as wasmtime-py reads it."""
    fastcall._patch_types()
    rt = _record_type([("role", T.String()), ("n", T.U32()), ("content", T.String())])
    values = {"role": role, "n": 9, "content": content}
    assert conv._FlatRecord.plan(rt.fields) is not None
    fast = conv._record_from_c(rt, _to_c(rt, values))  # frees the record
    ref = conv._RECORD_FROM_C(rt, _to_c(rt, values))
    assert fast.__dict__ == ref.__dict__ == values


def test_wasmtime_py_values_restores_both_ways() -> None:
    """The comparison switch: inside, lists and records convert as wasmtime-py does; after, fast again."""
    fastcall._patch_types()
    assert T.ListType.convert_to_c is conv._list_to_c and T.RecordType.convert_from_c is conv._record_from_c
    with fastcall.wasmtime_py_values():
        assert T.ListType.convert_to_c is conv._LIST_TO_C and T.ListType.convert_from_c is conv._LIST_FROM_C
        assert T.RecordType.convert_to_c is conv._RECORD_TO_C
        assert T.RecordType.convert_from_c is conv._RECORD_FROM_C
        lt = _u32_list_type()
        val = ffi.wasmtime_component_val_t()
        lt.convert_to_c(None, [4, 5], ctypes.pointer(val))
        assert lt.convert_from_c(val) == [4, 5]
    assert T.ListType.convert_to_c is conv._list_to_c and T.ListType.convert_from_c is conv._list_from_c
    assert T.RecordType.convert_to_c is conv._record_to_c


def test_a_host_functions_exception_stays_with_its_thread() -> None:
    """The exception a failing import leaves for its guest's caller is the calling thread's: another
    thread whose guest trapped meanwhile does not take it (wasmtime-py keeps one global)."""
    from wasmtime import Engine, Store, WasmtimeError
    from wasmtime.component import _enter

    fastcall._patch_types()
    store = Store(Engine())

    def fail(_store: object) -> None:
        raise LookupError("the other instance's")

    def other() -> None:
        assert _enter.catch_exceptions(store._context(), fail) != 0  # an error for its guest

    t = threading.Thread(target=other)
    t.start()
    t.join()
    _enter.maybe_raise_last_exn()  # this thread's: nothing
    with pytest.raises(WasmtimeError, match="trap here"):
        _enter.enter_wasm(lambda: WasmtimeError("trap here")._consume())  # a trap of this thread's own


@pytest.mark.parametrize("values", [b"\x00", b"hello", bytes(range(256)) * 40])
def test_byte_lists_match_wasmtime_py(values: bytes) -> None:
    """list<u8> (HTTP bodies) both ways: the same elements as wasmtime-py's element-wise conversion,
    read back by it and by the fast path."""
    fastcall._patch_types()
    lt = T.ListType.__new__(T.ListType)
    lt.__dict__["element"] = T.U8.__new__(T.U8)
    fast, ref = ffi.wasmtime_component_val_t(), ffi.wasmtime_component_val_t()
    conv._list_to_c(lt, None, values, ctypes.pointer(fast))
    conv._LIST_TO_C(lt, None, values, ctypes.pointer(ref))
    elements = [(fast.of.list.data[i].kind, fast.of.list.data[i].of.u8) for i in range(fast.of.list.size)]
    assert elements == [(ref.of.list.data[i].kind, ref.of.list.data[i].of.u8) for i in range(ref.of.list.size)]
    assert elements == [(ffi.WASMTIME_COMPONENT_U8.value, b) for b in values]
    assert conv._list_from_c(lt, fast) == values
    assert conv._LIST_FROM_C(lt, ref) == values
