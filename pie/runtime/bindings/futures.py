"""`futures`: pollables, the watch/wait set, and the unit and string futures."""

from __future__ import annotations

from typing import Any

from wasmtime.component import ResourceType, Variant

from pie.control.errors import HostError
from pie.control.future import HostFuture
from pie.runtime.bindings.common import PACKAGE, Bindings, Kind, error_record


def _unit_result(future: HostFuture) -> Variant:
    try:
        future.result()
        return Variant("some", None)
    except HostError as e:
        return Variant("some", error_record(e))


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("futures")) as futures:
        b.counted(futures)
        for name, kind in (("pollable", Kind.POLLABLE), ("future-unit", Kind.FUTURE_UNIT),
                           ("future-string", Kind.FUTURE_STRING)):
            futures.add_resource(name, ResourceType.host(kind), b.drop)
        futures.add_func("[method]pollable.ready",
                         b.call(lambda st, store, p: st.get(store, p, Kind.POLLABLE).done(), False))
        futures.add_func("[method]pollable.watch",
                         b.call(lambda st, store, p, key: st.watch(store, p, key), False))
        futures.add_func("wait", b.call(lambda st, store: st.wait(), False))
        futures.add_func("[method]future-unit.subscribe", b.call(b.subscribe_to(Kind.FUTURE_UNIT), False))
        futures.add_func("[method]future-unit.get",
                         b.call(b.future_getter(Kind.FUTURE_UNIT, _unit_result, Variant("none")), False))
        futures.add_func("[method]future-string.subscribe", b.call(b.subscribe_to(Kind.FUTURE_STRING), False))
        futures.add_func("[method]future-string.get",
                         b.call(b.future_getter(Kind.FUTURE_STRING, lambda f: f.result()), False))
