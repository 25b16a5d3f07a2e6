"""The host-call fast paths of pie/runtime/wasmtime_compat.py give exactly what wasmtime-py's
own conversions give: lists of numbers lowered by one and lifted by the other (both ways),
strings as byte vectors, and the rebound C calls that keep the GIL."""

from __future__ import annotations

import ctypes
import random

import pytest
from wasmtime import _bindings
from wasmtime import _ffi as ffi
from wasmtime.component import _types

from pie.runtime import wasmtime_compat

GENERIC = (_types.ListType.convert_from_c, _types.ListType.convert_to_c)


class ListOf:
    """Enough of a wasmtime ListType (its element type) for the conversion functions."""

    _is_bytes = _types.ListType._is_bytes

    def __init__(self, element: object):
        self.element = element


def values(element: type) -> list | bytes:
    rng = random.Random(element.__name__)
    if element is _types.U8:
        return bytes(rng.randrange(256) for _ in range(50))
    if element in (_types.F32, _types.F64):
        return [rng.choice([0.0, -2.5, 2.0 ** 100, 3.25]) for _ in range(50)]  # exact in f32
    bits = int(element.__name__[1:])
    low, high = (0, 2 ** bits) if element.__name__[0] == "U" else (-(2 ** (bits - 1)), 2 ** (bits - 1))
    return [rng.randrange(low, high) for _ in range(49)] + [high - 1]


@pytest.mark.parametrize("element", list(wasmtime_compat._NUMBER_FORMATS))
def test_number_lists_convert_as_wasmtime_py_does(element):
    lift, lower = wasmtime_compat._number_lists()
    generic_lift, generic_lower = GENERIC
    ty = ListOf(element())
    for vals in (values(element), b"" if element is _types.U8 else []):
        for put, get in ((lower, generic_lift), (generic_lower, lift), (lower, lift)):
            cell = ffi.wasmtime_component_val_t()
            put(ty, None, vals, ctypes.pointer(cell))
            assert get(ty, cell) == vals


def test_bad_numbers_are_refused_and_other_lists_take_the_generic_path():
    lift, lower = wasmtime_compat._number_lists()
    u32 = ListOf(_types.U32())
    for bad, error in (([-1], OverflowError), ([2 ** 32], OverflowError), (["7"], TypeError), ((1, 2), TypeError)):
        with pytest.raises(error):
            lower(u32, None, bad, ctypes.pointer(ffi.wasmtime_component_val_t()))
    strings = ListOf(_types.String())
    cell = ffi.wasmtime_component_val_t()
    lower(strings, None, ["a", "bé"], ctypes.pointer(cell))
    assert lift(strings, cell) == ["a", "bé"]


def test_strings_and_bytes_become_the_same_byte_vectors():
    str_to_capi, bytes_to_capi = wasmtime_compat._byte_vectors()
    for text in ("", "status", "é€😀" * 40):
        for _ in range(2):  # a short string's second conversion comes from the cache
            vec = str_to_capi(text)
            assert ffi.to_bytes(vec) == text.encode()
            ffi.wasm_byte_vec_delete(ctypes.byref(vec))
    vec = bytes_to_capi(bytearray(b"\x00\xff"))
    assert ffi.to_bytes(vec) == b"\x00\xff"
    ffi.wasm_byte_vec_delete(ctypes.byref(vec))
    with pytest.raises(TypeError):
        str_to_capi(b"bytes")
    with pytest.raises(TypeError):
        bytes_to_capi("text")


def test_short_c_calls_keep_the_gil_and_guest_calls_release_it():
    wasmtime_compat.install_gil_holding_calls()
    holds = lambda name: bool(getattr(_bindings, "_" + name)._flags_ & ctypes._FUNCFLAG_PYTHONAPI)  # noqa: E731
    assert all(holds(name) for name in wasmtime_compat.GIL_HOLDING)
    assert not holds("wasmtime_component_func_call")  # runs guest code: other threads go on
    assert not holds("wasmtime_component_resource_any_drop")  # may run a guest destructor
