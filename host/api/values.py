"""Converting values between Python and wasmtime's C values, faster than wasmtime-py for the
shapes every inferlet's start and end passes (its arguments, chat messages, prompt tokens, the
`generation` record); host/api/fastcall.py installs them (`install`) with its type memos.

- a `list<u32>` is written and read with C-level slices instead of a Python call per element;
- a `list<string>` is written with each byte vector made in place, and read in one unpack;
- a record result is written entry by entry in place, its field names encoded once per type;
- a record argument of scalars and strings is read in one struct.unpack_from (the names come
  from the type, in the same order);
- the C helpers a conversion calls keep the GIL, and str / bytes <-> byte vectors take one call.
Same values, same frees (tests/test_fastcall.py checks each against wasmtime-py's own).
"""

from __future__ import annotations

import ctypes
import re
import struct
from typing import Any

from wasmtime import _bindings as B
from wasmtime import _ffi as ffi
from wasmtime.component import _types as T

__all__ = ["ORIGINALS", "install"]


def install() -> None:
    """Replace wasmtime-py's list and record conversions and byte-vector helpers with these (once,
    process-wide: the caller guards it)."""
    T.ListType.convert_from_c = _list_from_c  # type: ignore[method-assign]
    T.ListType.convert_to_c = _list_to_c  # type: ignore[method-assign]
    T.RecordType.convert_from_c = _record_from_c  # type: ignore[method-assign]
    T.RecordType.convert_to_c = _record_to_c  # type: ignore[method-assign]
    _hold_gil_in_helpers()
    _patch_byte_vecs()


# The C helpers a value conversion calls: they allocate, free or read small structs, never run
# guest code and never block.
_HELPERS = re.compile(r"^_(wasmtime_component_val(list|tuple|record|flags)?_|wasm_byte_vec_|wasm_name_|"
                      r"wasmtime_component_\w+_type_)")


_CFUNC_PTR: Any = type(ffi.dll.wasmtime_component_val_new)


def _hold_gil_in_helpers() -> None:
    """Call the conversion helpers without releasing the GIL (as ctypes.PyDLL does).

    ctypes releases the GIL around every foreign call. A host call converts its arguments and
    result with a few of these helpers; with other instance threads waiting for the GIL, each
    release hands the GIL over and the converting thread must wait to get it back: a thread
    switch per helper call, for a call that takes well under a microsecond."""
    held = ctypes.PyDLL(ffi.dll._name, handle=ffi.dll._handle)
    for name, fn in list(vars(B).items()):
        if not _HELPERS.match(name) or not isinstance(fn, _CFUNC_PTR):
            continue
        fast: Any = getattr(held, name[1:], None)
        if fast is None:
            continue
        fast.restype, fast.argtypes = fn.restype, fn.argtypes
        setattr(B, name, fast)


_BYTE_VECS = (ffi.bytes_to_capi, ffi.str_to_capi, ffi.to_bytes, ffi.to_str)  # wasmtime-py's own


def _patch_byte_vecs() -> None:
    """Faster equivalents of wasmtime-py's conversions between str / bytes and C byte vectors,
    used for every string value, enum case and record field name that crosses a host call.

    wasmtime-py's `bytes_to_capi` makes a new ctypes array type for each value's length, copies
    the bytes into it and then into the vector with `ctypes.memmove`, which releases the GIL; its
    `to_bytes` makes an array type too. Measured in a burst of 256 `text_completion` instances:
    ~260 us of value conversion per instance (lowering the `generation` record alone ~50 us: five
    byte vectors, its four field names and the `finish` case) against ~35 us of the imports' own
    work. Here one held-GIL `wasm_byte_vec_new` copies a `bytes` object's buffer, and
    `ctypes.string_at` reads a vector. Same vectors, same strings."""
    held = ctypes.PyDLL(ffi.dll._name, handle=ffi.dll._handle)
    new = held.wasm_byte_vec_new
    new.restype, new.argtypes = None, [ctypes.POINTER(ffi.wasm_byte_vec_t), ctypes.c_size_t, ctypes.c_char_p]
    byref, string_at, vec_t = ctypes.byref, ctypes.string_at, ffi.wasm_byte_vec_t

    def bytes_to_capi(s: bytes | bytearray) -> Any:
        if type(s) is not bytes:
            if not isinstance(s, (bytes, bytearray)):
                raise TypeError("expected bytes or bytearray")
            s = bytes(s)
        vec = vec_t()
        new(byref(vec), len(s), s)
        return vec

    def str_to_capi(s: str) -> Any:
        if not isinstance(s, str):
            raise TypeError("expected a string")
        b = s.encode("utf8")
        vec = vec_t()
        new(byref(vec), len(b), b)
        return vec

    def to_bytes(vec: Any) -> bytearray:
        return bytearray(string_at(vec.data, vec.size)) if vec.size else bytearray()

    def to_str(vec: Any) -> str:
        return string_at(vec.data, vec.size).decode("utf-8") if vec.size else ""

    ffi.bytes_to_capi, ffi.str_to_capi, ffi.to_bytes, ffi.to_str = bytes_to_capi, str_to_capi, to_bytes, to_str


_LIST_FROM_C = T.ListType.convert_from_c
_RECORD_FROM_C = T.RecordType.convert_from_c
_LIST_TO_C = T.ListType.convert_to_c
_RECORD_TO_C = T.RecordType.convert_to_c
ORIGINALS = {("ListType", "convert_from_c"): _LIST_FROM_C, ("ListType", "convert_to_c"): _LIST_TO_C,
              ("RecordType", "convert_from_c"): _RECORD_FROM_C, ("RecordType", "convert_to_c"): _RECORD_TO_C}
_VAL_SIZE = ctypes.sizeof(ffi.wasmtime_component_val_t)
_U32_OFFSET = ffi.wasmtime_component_val_t.of.offset  # the union's start; u32 sits at its start
_U32_STRIDE = _VAL_SIZE // 4
_U32_KIND = ffi.WASMTIME_COMPONENT_U32.value
_U8_KIND = ffi.WASMTIME_COMPONENT_U8.value
_STRING_KIND = ffi.WASMTIME_COMPONENT_STRING.value
_BOOL_KIND = ffi.WASMTIME_COMPONENT_BOOL.value
_VAL = ffi.wasmtime_component_val_t
_VAL_PTR = ctypes.POINTER(_VAL)
# wasm_byte_vec_new(out, size, data) into a vector at an address (in a list element or a record
# entry), the GIL held as in `_patch_byte_vecs`
_BYTE_VEC_NEW_AT = ctypes.PyDLL(ffi.dll._name, handle=ffi.dll._handle).wasm_byte_vec_new
_BYTE_VEC_NEW_AT.restype, _BYTE_VEC_NEW_AT.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def _list_to_c(self: T.ListType, store: Any, val: Any, ptr: Any) -> None:
    """wasmtime-py's ListType.convert_to_c, with fast paths for a list<u32> (two C-level slice
    writes: the kinds and the values) and a list<string> (each string's byte vector made in place)."""
    element = type(self.element)
    if element is T.U8 and type(val) is bytes and val:
        _bytes_to_c(val, ptr)
        return
    if type(val) is not list or not val or _VAL_SIZE % 4 or _U32_OFFSET % 4 or (
            element is not T.U32 and element is not T.String):
        _LIST_TO_C(self, store, val, ptr)
        return
    n = len(val)
    data: list[bytes] = []
    if element is T.String:
        try:  # (before anything is allocated)
            data = [v.encode("utf8") for v in val] if all(type(v) is str for v in val) else []
        except UnicodeEncodeError:  # a lone surrogate
            pass
        if not data:  # wasmtime-py's own error, or its way for str subclasses
            _LIST_TO_C(self, store, val, ptr)
            return
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, n)
    base = ctypes.addressof(raw.data.contents)
    kinds = (ctypes.c_uint8 * (n * _VAL_SIZE)).from_address(base)
    if element is T.U32:
        words = (ctypes.c_uint32 * (n * _U32_STRIDE)).from_address(base)
        try:  # ctypes stores an int as c_uint32 does (masked to 32 bits), and refuses what is not one
            words[_U32_OFFSET // 4 :: _U32_STRIDE] = val
        except TypeError:
            kinds[0::_VAL_SIZE] = [_BOOL_KIND] * n  # nothing to free in them
            ffi.wasmtime_component_vallist_delete(ctypes.byref(raw))
            _LIST_TO_C(self, store, val, ptr)  # raises wasmtime-py's own error
            return
        kinds[0::_VAL_SIZE] = [_U32_KIND] * n
    else:
        new = _BYTE_VEC_NEW_AT
        for i, b in enumerate(data):
            new(base + i * _VAL_SIZE + _U32_OFFSET, len(b), b)
        kinds[0::_VAL_SIZE] = [_STRING_KIND] * n
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
    ptr.contents.of.list = raw


def _bytes_to_c(val: bytes, ptr: Any) -> None:
    """A list<u8> (an HTTP body) written as one image of its values: each element's kind byte and
    its byte at the union's start, in one copy (wasmtime-py converts it element by element: ~1 us a
    byte)."""
    n = len(val)
    image = bytearray(n * _VAL_SIZE)
    image[0::_VAL_SIZE] = bytes((_U8_KIND,)) * n
    image[_U32_OFFSET::_VAL_SIZE] = val
    raw = ffi.wasmtime_component_vallist_t()
    ffi.wasmtime_component_vallist_new_uninit(raw, n)
    ctypes.memmove(ctypes.addressof(raw.data.contents), bytes(image), len(image))
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
    ptr.contents.of.list = raw


def _record_to_c(self: T.RecordType, store: Any, val: Any, ptr: Any) -> None:
    """wasmtime-py's RecordType.convert_to_c, writing each entry in place: its field name's byte
    vector made from bytes encoded once per type, its value converted into the entry."""
    fields = self.fields
    d = self.__dict__
    names = d.get("_name_bytes")
    if names is None:
        names = d["_name_bytes"] = [name.encode("utf8") for name, _ in fields]
    n = len(fields)
    raw = ffi.wasmtime_component_valrecord_t()
    ffi.wasmtime_component_valrecord_new_uninit(raw, n)
    base = ctypes.addressof(raw.data.contents) if n else 0
    i = 0
    try:
        for (name, ty), b in zip(fields, names, strict=True):
            at = base + i * _ENTRY_SIZE
            ty.convert_to_c(store, getattr(val, name), _VAL_PTR(_VAL.from_address(at + _ENTRY_VAL)))
            _BYTE_VEC_NEW_AT(at + _ENTRY_NAME, len(b), b)
            i += 1
    except BaseException:
        for j in range(i, n):  # not written (or half): an empty name and a value owning nothing
            entry = _ENTRY.from_address(base + j * _ENTRY_SIZE)
            entry.name.size, entry.name.data = 0, None
            entry.val.kind = ffi.WASMTIME_COMPONENT_BOOL
            entry.val.of.boolean = False
        ffi.wasmtime_component_valrecord_delete(ctypes.byref(raw))
        raise
    ptr.contents.kind = ffi.WASMTIME_COMPONENT_RECORD
    ptr.contents.of.record = raw


def _list_from_c(self: T.ListType, c: Any) -> Any:
    """wasmtime-py's ListType.convert_from_c, with fast paths for list<u32> (one C-level slice) and
    list<string> (each element's size and data pointer in one unpack). Either way the elements are
    read in place and the list's delete frees them."""
    element = type(self.element)
    if not ((element is T.U32 and not _VAL_SIZE % 4 and not _U32_OFFSET % 4) or element is T.U8
            or (element is T.String and ctypes.sizeof(ctypes.c_void_p) == 8 and _VAL_SIZE >= _U32_OFFSET + 16)):
        return _LIST_FROM_C(self, c)
    assert c.kind == ffi.WASMTIME_COMPONENT_LIST.value
    try:
        n = c.of.list.size
        if n == 0:
            return b"" if element is T.U8 else []
        base = ctypes.addressof(c.of.list.data.contents)
        if element is T.U32:
            return (ctypes.c_uint32 * (n * _U32_STRIDE)).from_address(base)[_U32_OFFSET // 4 :: _U32_STRIDE]
        if element is T.U8:  # (u8 values own nothing: the list's delete frees them as they are)
            return _string_at(base, n * _VAL_SIZE)[_U32_OFFSET::_VAL_SIZE]
        out = []
        for kind, size, data in _STRING_VALS.iter_unpack((ctypes.c_char * (n * _VAL_SIZE)).from_address(base)):
            assert kind == _STRING_KIND
            out.append(_string_at(data, size).decode("utf-8") if size else "")
        return out
    finally:
        ffi.wasmtime_component_valtuple_delete(ctypes.byref(c.of.tuple))


_STRING_VALS = struct.Struct(f"<B{_U32_OFFSET - 1}xQQ{_VAL_SIZE - _U32_OFFSET - 16}x")  # kind, size, data
_string_at = ctypes.string_at


# Scalar field types: (their kind tag in a val, how their value is laid out in the val's union).
_SCALARS: dict[type, tuple[int, str]] = {
    T.Bool: (ffi.WASMTIME_COMPONENT_BOOL.value, "?"), T.S8: (ffi.WASMTIME_COMPONENT_S8.value, "b"),
    T.U8: (ffi.WASMTIME_COMPONENT_U8.value, "B"), T.S16: (ffi.WASMTIME_COMPONENT_S16.value, "h"),
    T.U16: (ffi.WASMTIME_COMPONENT_U16.value, "H"), T.S32: (ffi.WASMTIME_COMPONENT_S32.value, "i"),
    T.U32: (ffi.WASMTIME_COMPONENT_U32.value, "I"), T.S64: (ffi.WASMTIME_COMPONENT_S64.value, "q"),
    T.U64: (ffi.WASMTIME_COMPONENT_U64.value, "Q"), T.F32: (ffi.WASMTIME_COMPONENT_F32.value, "f"),
    T.F64: (ffi.WASMTIME_COMPONENT_F64.value, "d"),
}
_OPTION_KIND = ffi.WASMTIME_COMPONENT_OPTION.value
_ENTRY = ffi.wasmtime_component_valrecord_entry_t
_ENTRY_SIZE = ctypes.sizeof(_ENTRY)
_ENTRY_NAME, _ENTRY_VAL = _ENTRY.name.offset, _ENTRY.val.offset  # in an entry
_KIND_AT = _ENTRY.val.offset + ffi.wasmtime_component_val_t.kind.offset
_VALUE_AT = _ENTRY.val.offset + ffi.wasmtime_component_val_t.of.offset


class _FlatRecord:
    """How to read a record of scalar and string fields (and options, read as their payload
    pointer: only a `none`, a null pointer, is taken as is) in one struct.unpack_from of its entry
    array. A string is read in place (its size and data pointer); the record's delete frees it."""

    def __init__(self, fields: list[tuple[str, Any]]) -> None:
        fmt, kinds, pos, at = ["<"], [], 0, 0
        self.options: list[int] = []  # indices of option fields
        self.strings: list[int] = []  # and of string fields
        self.kind_at: list[int] = []  # each field's kind in the unpacked tuple (its value follows)
        for i, (_name, ty) in enumerate(fields):
            if type(ty) is T.OptionType:
                kind, code = _OPTION_KIND, "Q"
                self.options.append(i)
            elif type(ty) is T.String:
                kind, code = _STRING_KIND, "QQ"  # wasm_byte_vec_t: size, data
                self.strings.append(i)
            else:
                kind, code = _SCALARS[type(ty)]
            base = i * _ENTRY_SIZE
            fmt += [f"{base + _KIND_AT - pos}x" if base + _KIND_AT > pos else "", "B",
                    f"{_VALUE_AT - _KIND_AT - 1}x", code]
            pos = base + _VALUE_AT + struct.calcsize("<" + code)
            kinds.append(kind)
            self.kind_at.append(at)
            at += 1 + len(code)
        self.struct = struct.Struct("".join(fmt))
        self.names = [name for name, _ in fields]
        self.kinds = tuple(kinds)
        self.size = len(fields)
        self.buffer = ctypes.c_char * (self.size * _ENTRY_SIZE)
        self.plain = not self.strings  # two items per field: kind, value

    @staticmethod
    def plan(fields: list[tuple[str, Any]]) -> _FlatRecord | None:
        if ctypes.sizeof(ctypes.c_void_p) != 8 or not fields:
            return None
        for _name, ty in fields:
            if type(ty) not in _SCALARS and type(ty) is not T.OptionType and type(ty) is not T.String:
                return None
        return _FlatRecord(fields)

    def read(self, record: Any) -> list[Any] | None:
        """The field values, or None when a field is not as planned (an option holding a value)."""
        if record.size != self.size:
            return None
        got = self.struct.unpack_from(self.buffer.from_address(ctypes.addressof(record.data.contents)))
        if self.plain:
            if got[0::2] != self.kinds:
                return None
            values = list(got[1::2])
        else:
            if tuple(got[k] for k in self.kind_at) != self.kinds:
                return None
            values = [got[k + 1] for k in self.kind_at]
            for i in self.strings:
                k = self.kind_at[i]
                size = got[k + 1]
                values[i] = _string_at(got[k + 2], size).decode("utf-8") if size else ""
        for i in self.options:
            if values[i]:
                return None  # some(...): its payload is converted the general way
            values[i] = None
        return values


def _record_from_c(self: T.RecordType, c: Any) -> Any:
    """wasmtime-py's RecordType.convert_from_c without decoding every field name from C; a record
    of scalars and strings (the sampler of every decode step, a chat message) is read in one
    struct.unpack_from."""
    assert c.kind == ffi.WASMTIME_COMPONENT_RECORD.value
    try:
        d = self.__dict__
        flat = d.get("_flat", False)
        if flat is False:
            flat = d["_flat"] = _FlatRecord.plan(self.fields)
        ret = T.Record()
        values = None if flat is None else flat.read(c.of.record)
        if values is not None:
            ret.__dict__.update(zip(flat.names, values, strict=True))
            return ret
        d = ret.__dict__
        data = c.of.record.data
        for i, (name, ty) in zip(range(c.of.record.size), self.fields, strict=False):
            raw = data[i].val
            d[name] = ty.convert_from_c(raw)
            raw.kind = ffi.WASMTIME_COMPONENT_BOOL
            raw.of.boolean = False
        return ret
    finally:
        ffi.wasmtime_component_valrecord_delete(c.of.record)
