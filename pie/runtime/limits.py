"""Limits of one instance that wasmtime's store limits cannot express, through its C API.

wasmtime-py 50 exposes only `Store.set_limits` (wasmtime's `StoreLimits`): a cap on *each*
linear memory and on *each* table, and counts of memories, tables and core instances. Its
C API has no resource-limiter callback, so a component with several memories could hold
`max_memories × memory_limit_mb`. Two C API hooks close the gaps; both are reached through
wasmtime-py's raw bindings (`wasmtime._ffi`) because the Python API does not wrap them:

- `HostMemories`, a host memory creator (`wasmtime_config_host_memory_creator_set`):
  wasmtime asks it for every linear memory and for every growth of one, so it can charge
  all memories of one instance to one `MemoryBudget` and refuse what goes past it. Each
  memory is laid out as compiled code assumes (it elides bounds checks on that): the
  reservation wasmtime asks for plus its guard region mapped inaccessible, the accessible
  prefix opened as the memory grows, never moved. The cost: wasmtime's copy-on-write
  memory images need its own memories, so the engine must run with `memory_init_cow` off
  and each instantiation copies its data segments (see Runtime.__init__).
- `DeadlineCallback` (`wasmtime_store_epoch_deadline_callback`): instead of trapping when
  an epoch deadline passes, wasmtime calls back, and the instance either goes on (a new
  deadline) or traps with the reason the callback gives. That lets a stretch of pure guest
  computation be checked against the CPU slice, the CPU and wall budgets, a refused memory
  growth and termination, without a host call.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from wasmtime import Config, Store
from wasmtime import _ffi as ffi

__all__ = ["DeadlineCallback", "HostMemories", "MemoryBudget"]

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0)
_MAP_FAILED = ctypes.c_void_p(-1).value
_UPDATE_DEADLINE_CONTINUE = 0  # wasmtime_update_deadline_kind_t: WASMTIME_UPDATE_DEADLINE_CONTINUE
# C signatures of wasmtime.h, as wasmtime-py's bindings declare them (immutable types).
_FINALIZER_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_DEADLINE_CALLBACK_T = ctypes.CFUNCTYPE(
    ctypes.c_size_t, ctypes.POINTER(ffi.wasmtime_context_t), ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ffi.wasmtime_update_deadline_kind_t))


def _error(message: str) -> int:
    """A new wasmtime_error_t (wasmtime takes ownership) as the integer a callback returns."""
    return ctypes.cast(ffi.wasmtime_error_new(message.encode()), ctypes.c_void_p).value or 0


class MemoryBudget:
    """The bytes of linear memory one instance holds, all its memories together, and the
    cap on them. Used only on the instance's own thread (memories are created, grown and
    freed there), so it needs no lock."""

    def __init__(self, limit_bytes: int, refusal: str):
        self.limit = limit_bytes
        self.used = 0
        self.peak = 0
        self.memories = 0
        self.refusal = refusal  # the reason given when a growth is refused
        self.refused: str | None = None  # set once a creation or growth was refused

    def charge(self, delta: int) -> bool:
        """Take `delta` more bytes if they fit under the cap; remember a refusal."""
        if self.used + delta > self.limit:
            self.refused = self.refusal
            return False
        self.used += delta
        self.peak = max(self.peak, self.used)
        return True


@dataclass
class _Memory:
    base: int  # address of byte 0
    span: int  # bytes reserved for the memory to grow into (the guard region follows)
    mapped: int  # bytes mapped: span + guard
    size: int  # accessible bytes (the wasm memory's current byte size)
    budget: MemoryBudget


class HostMemories:
    """Allocates every linear memory of an engine, charging each to the `MemoryBudget` of
    the instance whose thread creates it (`charging`): a memory that would not fit is not
    created (instantiation fails), a `memory.grow` that would not fit returns -1 to the guest
    and marks the budget `refused`. Memories are freed when their store is deleted.

    Install it on the engine's Config before the Engine is made; keep this object alive
    as long as the engine (it owns the C callbacks wasmtime calls)."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_long]
        self.libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.page = mmap.PAGESIZE
        self.current = threading.local()  # .budget: the instance being instantiated here
        self.memories: dict[int, _Memory] = {}  # env key handed to wasmtime -> memory
        self.keys = itertools.count(1)
        self.lock = threading.Lock()
        # The C callbacks, referenced here so they live as long as this object.
        self.new_cb = ffi.wasmtime_new_memory_callback_t(self._new_memory)
        self.get_cb = ffi.wasmtime_memory_get_callback_t(self._get_memory)
        self.grow_cb = ffi.wasmtime_memory_grow_callback_t(self._grow_memory)
        self.free_cb = _FINALIZER_T(self._free_memory)
        self.no_finalizer = ctypes.cast(None, _FINALIZER_T)

    def install(self, config: Config) -> None:
        creator = ffi.wasmtime_memory_creator_t(None, self.new_cb, self.no_finalizer)
        ffi.wasmtime_config_host_memory_creator_set(config.ptr(), ctypes.byref(creator))

    @contextmanager
    def charging(self, budget: MemoryBudget) -> Iterator[None]:
        """Memories created on this thread meanwhile (instantiation) are charged to `budget`."""
        self.current.budget = budget
        try:
            yield
        finally:
            self.current.budget = None

    def live(self) -> int:
        """Memories not yet freed (their stores are alive)."""
        with self.lock:
            return len(self.memories)

    # --- wasmtime's callbacks: each must return, never raise (ctypes would report success) --

    def _new_memory(self, _env, ty, minimum, maximum, reserved, guard, memory_ret) -> int:  # type: ignore[no-untyped-def]
        try:
            budget: MemoryBudget | None = getattr(self.current, "budget", None)
            if budget is None:
                return _error("linear memories are created only while an instance is instantiated")
            if ffi.wasmtime_memorytype_isshared(ty):
                return _error("shared memories are not supported")
            if not budget.charge(minimum):
                return _error(budget.refusal)
            # wasmtime passes its memory reservation (4 GiB on 64-bit hosts), which compiled
            # code relies on; should it pass none, the budget bounds the size anyway.
            span = self._round(max(reserved or 0, minimum if reserved else budget.limit))
            mapped = span + self._round(guard)
            base = self.libc.mmap(None, mapped, _PROT_NONE, _MAP_FLAGS, -1, 0)
            if base in (None, _MAP_FAILED):
                budget.used -= minimum
                return _error(f"cannot reserve {mapped} bytes of address space for a memory")
            if minimum and self.libc.mprotect(base, self._round(minimum), _PROT_RW) != 0:
                self.libc.munmap(base, mapped)
                budget.used -= minimum
                return _error("cannot commit a linear memory")
            key = next(self.keys)
            with self.lock:
                self.memories[key] = _Memory(base, span, mapped, minimum, budget)
            budget.memories += 1
            out = memory_ret.contents
            out.env = key
            out.get_memory = self.get_cb
            out.grow_memory = self.grow_cb
            out.finalizer = self.free_cb
            return 0
        except BaseException as e:  # noqa: BLE001 — must become a wasmtime error
            return _error(f"host memory creator failed: {type(e).__name__}: {e}")

    def _get_memory(self, env, byte_size, byte_capacity) -> int:  # type: ignore[no-untyped-def]
        memory = self.memories[env]
        byte_size[0] = memory.size
        byte_capacity[0] = memory.span
        return memory.base

    def _grow_memory(self, env, new_size) -> int:  # type: ignore[no-untyped-def]
        try:
            memory = self.memories[env]
            if new_size <= memory.size:
                return 0
            if new_size > memory.span:
                return _error(f"a linear memory cannot grow past its reservation of {memory.span} bytes")
            delta = new_size - memory.size
            if not memory.budget.charge(delta):
                return _error(memory.budget.refusal)
            start = memory.base + self._round_down(memory.size)
            if self.libc.mprotect(start, self._round(new_size) - (start - memory.base), _PROT_RW) != 0:
                memory.budget.used -= delta
                return _error("cannot commit a linear memory")
            memory.size = new_size
            return 0
        except BaseException as e:  # noqa: BLE001
            return _error(f"host memory creator failed: {type(e).__name__}: {e}")

    def _free_memory(self, env) -> None:  # type: ignore[no-untyped-def]
        with self.lock:
            memory = self.memories.pop(env, None)
        if memory is not None:
            self.libc.munmap(memory.base, memory.mapped)
            memory.budget.used -= memory.size
            memory.budget.memories -= 1

    def _round(self, n: int) -> int:
        return -(-n // self.page) * self.page

    def _round_down(self, n: int) -> int:
        return n // self.page * self.page


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
        try:
            reason = self.check()
            if reason is not None:
                return _error(reason)
            delta[0] = max(1, self.ticks())
            kind[0] = _UPDATE_DEADLINE_CONTINUE
            return 0
        except BaseException as e:  # noqa: BLE001
            return _error(f"deadline check failed: {type(e).__name__}: {e}")
