"""`forward`: the paper's transformer forward over embeds and KV pages, and page masks."""

from __future__ import annotations

from typing import Any

from pie.control.errors import ErrorKind, HostError
from pie.runtime.bindings.common import PACKAGE, Bindings
from pie.runtime.host import HostState


def register(root: Any, b: Bindings) -> None:
    def run_forward(st: HostState, store: Any, q: Any, p: Any) -> None:
        mask = getattr(p, "attention-mask")
        st.session.forward(b.queue(st, store, q), getattr(p, "input-kv-pages"),
                           getattr(p, "input-kv-last-page-len"), getattr(p, "input-embeds"),
                           getattr(p, "output-kv-pages"), getattr(p, "output-kv-offset"),
                           getattr(p, "output-embeds"), getattr(p, "output-token-indices"),
                           None if mask is None else bytes(mask))

    def forward_with_adapter(st: HostState, store: Any, q: Any, adapter: str, p: Any) -> None:
        b.queue(st, store, q)
        raise HostError(ErrorKind.UNSUPPORTED, f"adapter {adapter!r}: this model serves no LoRA adapters")

    with root.add_instance(PACKAGE.format("forward")) as forward:
        b.counted(forward)
        forward.add_func("forward", b.call(run_forward))
        forward.add_func("forward-with-adapter", b.call(forward_with_adapter))
        forward.add_func("mask-kvpage", b.call(
            lambda st, store, q, page, mask: st.session.mask_kvpage(b.queue(st, store, q), page, mask)))
