"""`kvs`: the per-user persistent key-value store."""

from __future__ import annotations

from typing import Any

from pie.runtime.bindings.common import PACKAGE, Bindings


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("kvs")) as kvs:
        b.counted(kvs)
        kvs.add_func("store-get", b.call(lambda st, store, k: st.session.store_get(k), False))
        kvs.add_func("store-set", b.call(lambda st, store, k, v: st.session.store_set(k, v)))
        kvs.add_func("store-delete", b.call(lambda st, store, k: st.session.store_delete(k), False))
