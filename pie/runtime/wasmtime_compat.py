"""A fix for a thread-safety bug in wasmtime-py (50.x), which Pie calls from many threads.

To lower an `option`/`result`/`variant` value, wasmtime-py collects the Python classes of
each case into one module-level set (`component._types.case_test_cache`), shared by every
thread. Two instances returning such values at once race on it and one fails with
"value not valid for this variant" (seen with 16 concurrent inferlets). Giving each thread
its own set removes the race; the lowering logic is unchanged.
"""

from __future__ import annotations

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
