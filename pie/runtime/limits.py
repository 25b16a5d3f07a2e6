"""The epoch-deadline callback of an instance's store: how guest code that makes no host
call is checked against its limits.

wasmtime interrupts guest code only at epoch deadlines (the runtime's epoch thread ticks
every EPOCH_TICK_S). By default a passed deadline traps; with a deadline callback
(`wasmtime_store_epoch_deadline_callback`, reached through wasmtime-py's raw bindings
`wasmtime._ffi`, as its Python API does not wrap it) wasmtime calls back instead, and the
instance either goes on until a new deadline or traps with the reason the callback gives.
That lets a stretch of pure guest computation be checked against the CPU slice
(runtime.cpu_slice_ms), the CPU and wall-clock budgets (quota.instance.cpu_s / wall_s) and
termination, without a host call (see HostState.on_deadline).

Memory, tables and core instances need nothing here: wasmtime's store limits bound them
(Runtime._store).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from wasmtime import Store
from wasmtime import _ffi as ffi

__all__ = ["DeadlineCallback"]

_UPDATE_DEADLINE_CONTINUE = 0  # wasmtime_update_deadline_kind_t: WASMTIME_UPDATE_DEADLINE_CONTINUE
# C signatures of wasmtime.h, as wasmtime-py's bindings declare them (immutable types).
_FINALIZER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DEADLINE_CALLBACK_T = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t))


def _error(message: str) -> int:
    """A new wasmtime_error_t (wasmtime takes ownership) as the integer a callback returns."""
    return ctypes.cast(ffi.wasmtime_error_new(message.encode()), ctypes.c_void_p).value or 0


class DeadlineCallback:
    """Called by wasmtime when a store's epoch deadline passes during guest code. `check()`
    returns None to let the guest go on for `ticks()` more epoch ticks, or the reason to
    trap with (the trap's message then carries it). Keep this object as long as the store."""

    def __init__(self, store: Store, check: Callable[[], str | None], ticks: Callable[[], int]):
        self.check = check
        self.ticks = ticks
        self.callback = _DEADLINE_CALLBACK_T(self._on_deadline)
        ffi.wasmtime_store_epoch_deadline_callback(store.ptr(), self.callback, None,
                                                   ctypes.cast(None, _FINALIZER_T))

    def _on_deadline(self, _context, _data, delta, kind) -> int:  # type: ignore[no-untyped-def]
        # Must return, never raise: ctypes would report success to wasmtime.
        try:
            reason = self.check()
            if reason is not None:
                return _error(reason)
            delta[0] = max(1, self.ticks())
            kind[0] = _UPDATE_DEADLINE_CONTINUE
            return 0
        except BaseException as e:  # noqa: BLE001
            return _error(f"deadline check failed: {type(e).__name__}: {e}")
