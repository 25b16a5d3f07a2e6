"""What every binding module shares: resource kinds, record builders, and `Bindings`, the
wrappers that turn a Python function into a host function of the shared linker.

Conventions of wasmtime-py 50 the bindings rely on:
- a `borrow<T>` argument arrives as a ResourceAny; `.to_host(store)` must be called on it
  exactly once (it also ends the borrow);
- `result<T, error>` is lowered untagged when T is not a record: return the value or an
  error `Record`; with a record T (and inside `option`) a `Variant("ok"/"err", ...)`.
Every call checks whether the instance is being terminated or is past a budget, and
restarts its CPU slice (`Bindings.call`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wasmtime.component import Record, Variant

from pie.control.errors import HostError
from pie.control.future import HostFuture
from pie.runtime.host import HostState, Kind

if TYPE_CHECKING:
    from pie.control.controller import Controller

__all__ = ["PACKAGE", "Bindings", "Kind", "error_record", "record"]

PACKAGE = "pie:inferlet/{}@0.1.0"


def error_record(error: HostError) -> Record:
    out = Record()
    out.kind = str(error.kind)
    out.message = error.message
    return out


def record(**fields: Any) -> Record:
    out = Record()
    for name, value in fields.items():
        setattr(out, name.replace("_", "-"), value)
    return out


class Bindings:
    """The context each binding module registers with: the controller, how a store finds
    its instance's `HostState`, and the wrappers every host function goes through."""

    def __init__(self, controller: Controller, lookup: Callable[[Any], HostState]):
        self.controller = controller
        self.lookup = lookup

    def call(self, func: Callable[..., Any], fallible: bool = True) -> Callable[..., Any]:
        """Wrap a host function: termination and budget checks (`HostState.check`), HostError
        → error record, and the restart of the CPU slice when guest code resumes."""

        def wrapper(st: HostState, store: Any, *args: Any) -> Any:
            st.check()
            try:
                return func(st, store, *args)
            except HostError as e:
                if not fallible:
                    raise
                return error_record(e)
            finally:
                st.resumed = time.monotonic()

        return wrapper

    def counted(self, interface: Any) -> Any:
        """Make `interface.add_func` count each function's calls in `st.calls`, and pass
        the instance's `HostState` first."""
        add_func, lookup = interface.add_func, self.lookup

        def add_counted(name: str, func: Callable[..., Any]) -> None:
            def run(store: Any, *args: Any) -> Any:
                st = lookup(store)
                st.calls[name] += 1
                return func(st, store, *args)
            add_func(name, run)

        interface.add_func = add_counted
        return interface

    def drop(self, store: Any, rep: int) -> None:
        try:
            self.lookup(store).drop(store, rep)
        except KeyError:
            pass  # the instance is gone and its whole table with it

    @staticmethod
    def queue(st: HostState, store: Any, q: Any) -> Any:
        return st.get(store, q, Kind.QUEUE)

    @staticmethod
    def future_getter(kind: Kind, convert: Callable[[HostFuture], Any], pending: Any = None):
        def get(st: HostState, store: Any, f: Any) -> Any:
            future = st.get(store, f, kind)
            return convert(future) if future.done() else pending
        return get

    @staticmethod
    def subscribe_to(kind: Kind):
        return lambda st, store, f: st.own(Kind.POLLABLE, st.get(store, f, kind))

    @staticmethod
    def tagged(future: HostFuture, ok: Callable[[Any], Any]) -> Variant:
        try:
            return Variant("ok", ok(future.result()))
        except HostError as e:
            return Variant("err", error_record(e))

    @staticmethod
    def untagged(future: HostFuture) -> Any:
        try:
            return future.result()
        except HostError as e:
            return error_record(e)
