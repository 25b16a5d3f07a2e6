"""`memory`: the reclaim class of KV pages (what a short pool may do with a paused
instance's pages; pie/control/reclaimer.py)."""

from __future__ import annotations

from typing import Any

from pie.runtime.bindings.common import PACKAGE, Bindings


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("memory")) as memory:
        b.counted(memory)
        # wasmtime-py passes an enum as its case name ("pinned", "swappable", "discardable").
        memory.add_func("set-kv-class", b.call(
            lambda st, store, pages, kv_class: st.session.set_kv_class(pages, kv_class)))
