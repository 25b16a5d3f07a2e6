"""A fix for a thread-safety bug in wasmtime-py (50.x), which Pie calls from many threads.

To lower an `option`/`result`/`variant` value, wasmtime-py collects the Python classes of
each case into one module-level set (`component._types.case_test_cache`), shared by every
thread. Two instances returning such values at once race on it and one fails with
"value not valid for this variant" (seen with 16 concurrent inferlets). Giving each thread
its own set removes the race; the lowering logic is unchanged.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

from wasmtime.component import _types


class PerThreadSet(threading.local):
    """The subset of `set` that wasmtime-py's lowering uses, one set per thread."""

    def __init__(self) -> None:
        self.items: set[type] = set()

    def clear(self) -> None:
        self.items.clear()

    def add(self, item: type) -> None:
        self.items.add(item)

    def __iter__(self) -> Iterator[type]:
        return iter(self.items)


def install() -> None:
    if not isinstance(_types.case_test_cache, PerThreadSet):
        _types.case_test_cache = PerThreadSet()


# --- host-call overhead ---------------------------------------------------------------------
# wasmtime-py reflects a host function's WIT type on every call (FuncType.params builds new
# ValType objects through several FFI calls each time) and re-derives whether each variant is
# tagged on every lowering. That was ~2/3 of the control process's CPU per generated token,
# CPU the backend's threads need on a small machine. Types never change for a registered
# function, so both are cached.


def _cached_func_impl() -> object:
    from wasmtime import _ffi as ffi
    from wasmtime.component import _linker
    from wasmtime.component._enter import catch_exceptions
    from wasmtime.component._types import FuncType

    cache: dict[int, tuple[object, list, object]] = {}  # slab index -> (func, params, result)

    @ffi.wasmtime_component_func_callback_t
    def func_impl(idx, context, ty_raw, args, nargs, results, nresults):  # type: ignore[no-untyped-def]
        def run(store):  # type: ignore[no-untyped-def]
            func = _linker.FUNCTIONS.get(idx or 0)
            hit = cache.get(idx)
            if hit is None or hit[0] is not func:  # slab indices are reused by new functions
                with FuncType._from_ptr(ty_raw, owner=store) as fty:
                    hit = cache[idx] = (func, [ty for _, ty in fty.params], fty.result)
            _, params, result_type = hit
            result = func(store, *[ty.convert_from_c(args[i]) for i, ty in enumerate(params)])
            if result_type is None:
                assert result is None, "a host function without results returned a value"
            else:
                result_type.convert_to_c(store, result, results)

        return catch_exceptions(context, run)

    return func_impl


def _memoize(cls: type, name: str) -> None:
    """Cache a reflected-type accessor (property or method) on each type object."""
    original = cls.__dict__[name]
    getter = original.fget if isinstance(original, property) else original
    if getattr(getter, "pie_memoized", False):
        return
    key = f"_pie_{name}"

    def cached(self):  # type: ignore[no-untyped-def]
        try:
            return self.__dict__[key]
        except KeyError:
            value = self.__dict__[key] = getter(self)
            return value

    cached.pie_memoized = True  # type: ignore[attr-defined]
    setattr(cls, name, property(cached) if isinstance(original, property) else cached)


def install_fast_calls() -> None:
    from wasmtime.component import _linker

    for cls, names in ((_types.VariantLikeType, ("_tagged",)), (_types.ListType, ("element",)),
                       (_types.RecordType, ("fields",)), (_types.TupleType, ("elements",)),
                       (_types.EnumType, ("names",)),
                       (_types.ResultType, ("ok", "err", "_cases")),
                       (_types.OptionType, ("payload", "_cases")),
                       (_types.VariantType, ("_cases",))):
        for name in names:
            _memoize(cls, name)

    if not getattr(_linker.func_impl, "pie_cached", False):
        impl = _cached_func_impl()
        impl.pie_cached = True  # type: ignore[attr-defined]
        _linker.func_impl = impl


# --- GIL hand-offs --------------------------------------------------------------------------
# wasmtime-py binds the C API through ctypes.CDLL, which releases the GIL around every foreign
# call, however short. Lowering one `take` result or one borrowed handle makes ~20 such calls
# (a byte vector per record field name and enum case, list and record allocations, resource
# handle conversions), and every release is a point where another of the control process's
# threads (one per instance, the scheduler, the event loop) can take the GIL: with 8 streaming
# inferlets, each token cost its instance thread ~0.9 ms of CPU, mostly these hand-offs and
# the context switches behind them. The calls below only allocate, copy or free (none runs
# guest code or blocks), so they are rebound to keep the GIL (ctypes.PyDLL); calls into the
# guest (`wasmtime_component_func_call`, resource drops) still release it.

GIL_HOLDING = (
    "wasm_byte_vec_new_uninitialized", "wasm_byte_vec_new", "wasm_byte_vec_delete",
    "wasmtime_component_resource_any_delete", "wasmtime_component_resource_any_to_host",
    "wasmtime_component_resource_host_new", "wasmtime_component_resource_host_rep",
    "wasmtime_component_resource_host_delete", "wasmtime_component_resource_host_to_any",
    "wasmtime_component_vallist_new_uninit", "wasmtime_component_vallist_delete",
    "wasmtime_component_valrecord_new_uninit", "wasmtime_component_valrecord_delete",
    "wasmtime_component_valtuple_new_uninit", "wasmtime_component_valtuple_delete",
    "wasmtime_component_val_new", "wasmtime_component_val_delete",
)


def _byte_vectors() -> tuple[object, object]:
    """wasmtime-py's `str_to_capi` and `bytes_to_capi` in one foreign call each (they made two,
    each a GIL release: allocate, then ctypes.memmove). Short strings (record field names, enum
    cases: ~7 per `take` result) keep their encoded bytes, at most STRING_CACHE of them."""
    from wasmtime import _ffi as ffi

    new, vector = ffi.wasm_byte_vec_new, ffi.wasm_byte_vec_t
    encoded: dict[str, object] = {}

    def bytes_to_capi(data: bytes | bytearray) -> object:
        if not isinstance(data, (bytes, bytearray)):
            raise TypeError("expected bytes or bytearray")
        vec = vector()
        new(ctypes.byref(vec), len(data), (ctypes.c_uint8 * len(data)).from_buffer_copy(data))
        return vec

    def str_to_capi(text: str) -> object:
        source = encoded.get(text)
        if source is None:
            if not isinstance(text, str):
                raise TypeError("expected a string")
            data = text.encode()
            source = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            if len(data) <= 32 and len(encoded) < STRING_CACHE:
                encoded[text] = source
        vec = vector()
        new(ctypes.byref(vec), len(source), source)  # type: ignore[arg-type]
        return vec

    return str_to_capi, bytes_to_capi


STRING_CACHE = 4096


def install_gil_holding_calls() -> None:
    from wasmtime import _bindings
    from wasmtime import _ffi as ffi

    if getattr(ffi.str_to_capi, "pie_fast", False):
        return
    holding = ctypes.PyDLL(ffi.dll._name, handle=ffi.dll._handle)
    for name in GIL_HOLDING:
        released = getattr(_bindings, "_" + name)
        held = getattr(holding, name)
        held.restype, held.argtypes = released.restype, released.argtypes
        setattr(_bindings, "_" + name, held)
    str_to_capi, bytes_to_capi = _byte_vectors()
    str_to_capi.pie_fast = True  # type: ignore[attr-defined]
    ffi.str_to_capi, ffi.bytes_to_capi = str_to_capi, bytes_to_capi


# --- lists of numbers -----------------------------------------------------------------------
# wasmtime-py converts a list one element at a time in Python (a ctypes pointer, a type check
# and a kind check each): lifting the ~128 token ids a streaming inferlet passes to
# `detokenize` cost 180 us of CPU. A list of numbers is an array of fixed-size
# `wasmtime_component_val_t` cells, so it is read and written here as one strided memoryview
# over the cells' payloads.

_NUMBER_FORMATS = {_types.U8: "B", _types.S8: "b", _types.U16: "H", _types.S16: "h",
                   _types.U32: "I", _types.S32: "i", _types.U64: "Q", _types.S64: "q",
                   _types.F32: "f", _types.F64: "d"}


def _number_lists() -> tuple[object, object]:
    from array import array

    from wasmtime import _ffi as ffi

    cell = ctypes.sizeof(ffi.wasmtime_component_val_t)
    payload = ffi.wasmtime_component_val_t.of.offset
    kind_values = {t: getattr(ffi, f"WASMTIME_COMPONENT_{t.__name__}").value for t in _NUMBER_FORMATS}
    lift_generic, lower_generic = _types.ListType.convert_from_c, _types.ListType.convert_to_c

    # ctypes.memmove releases the GIL (see above); this binding of the same function keeps it.
    memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
        ctypes._memmove_addr)  # type: ignore[attr-defined]

    strides = {fmt: cell // array(fmt).itemsize for fmt in _NUMBER_FORMATS.values()}  # cells in items

    def view(buffer: bytearray | bytes, fmt: str, n: int) -> memoryview:
        """The n (> 0) payloads of a cell array as one strided view of format `fmt`."""
        return memoryview(buffer)[payload: payload + n * cell].cast(fmt)[:: strides[fmt]]

    def convert_from_c(self, c):  # type: ignore[no-untyped-def]
        fmt = _NUMBER_FORMATS.get(type(self.element))
        if fmt is None:
            return lift_generic(self, c)
        n = c.of.list.size
        try:
            raw = ctypes.string_at(c.of.list.data, n * cell) if n else b""
            values = view(raw, fmt, n).tolist() if n else []
            return bytes(values) if fmt == "B" else values
        finally:
            ffi.wasmtime_component_vallist_delete(ctypes.byref(c.of.list))

    def convert_to_c(self, store, val, ptr):  # type: ignore[no-untyped-def]
        fmt = _NUMBER_FORMATS.get(type(self.element))
        if fmt is None:
            return lower_generic(self, store, val, ptr)
        if not isinstance(val, bytes if fmt == "B" else list):
            raise TypeError("expected bytes value" if fmt == "B" else "expected list value")
        n = len(val)
        cells = bytearray(n * cell)
        if n:
            cells[0::cell] = bytes((kind_values[type(self.element)],)) * n
            view(cells, fmt, n)[:] = array(fmt, val)  # OverflowError/TypeError on a bad element
        raw = ffi.wasmtime_component_vallist_t()
        ffi.wasmtime_component_vallist_new_uninit(raw, n)
        if n:
            memmove(ctypes.cast(raw.data, ctypes.c_void_p), (ctypes.c_char * len(cells)).from_buffer(cells), len(cells))
        ptr.contents.kind = ffi.WASMTIME_COMPONENT_LIST
        ptr.contents.of.list = raw

    return convert_from_c, convert_to_c


def install_fast_lists() -> None:
    if getattr(_types.ListType.convert_from_c, "pie_fast", False):
        return
    lift, lower = _number_lists()
    lift.pie_fast = lower.pie_fast = True  # type: ignore[attr-defined]
    _types.ListType.convert_from_c, _types.ListType.convert_to_c = lift, lower  # type: ignore[method-assign]
