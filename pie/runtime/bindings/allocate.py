"""`allocate`: KV pages and embeds — allocation, copies, exports and imports."""

from __future__ import annotations

from typing import Any

from pie.runtime.bindings.common import PACKAGE, Bindings


def register(root: Any, b: Bindings) -> None:
    q = b.queue
    with root.add_instance(PACKAGE.format("allocate")) as allocate:
        b.counted(allocate)
        allocate.add_func("alloc-kvpage", b.call(lambda st, store, x, n: st.session.alloc_kvpage(q(st, store, x), n)))
        allocate.add_func("dealloc-kvpage", b.call(
            lambda st, store, x, pages: st.session.dealloc_kvpage(q(st, store, x), pages)))
        allocate.add_func("alloc-emb", b.call(lambda st, store, x, n: st.session.alloc_emb(q(st, store, x), n)))
        allocate.add_func("dealloc-emb", b.call(
            lambda st, store, x, embeds: st.session.dealloc_emb(q(st, store, x), embeds)))
        allocate.add_func("copy-kvpage", b.call(
            lambda st, store, x, src, dst, so, do, n: st.session.copy_kvpage(q(st, store, x), src, dst, so, do, n)))
        allocate.add_func("export-kvpage", b.call(
            lambda st, store, pages, name, persistent: st.session.export_kvpage(pages, name, persistent)))
        allocate.add_func("import-kvpage", b.call(lambda st, store, name: st.session.import_kvpage(name)))
        allocate.add_func("unexport-kvpage", b.call(lambda st, store, name: st.session.unexport_kvpage(name)))
        allocate.add_func("kv-page-size",
                          b.call(lambda st, store, x: (q(st, store, x), st.session.page_size)[1], False))
