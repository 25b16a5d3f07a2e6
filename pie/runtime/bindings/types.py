"""`types`: the queue resource (handles, errors and records shared by every trait)."""

from __future__ import annotations

from typing import Any

from wasmtime.component import ResourceType

from pie.runtime.bindings.common import PACKAGE, Bindings, Kind


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("types")) as types:
        b.counted(types)
        types.add_resource("queue", ResourceType.host(Kind.QUEUE), b.drop)
