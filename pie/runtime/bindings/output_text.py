"""`output-text`: next-token distributions and host-side sampling from output embeds."""

from __future__ import annotations

from typing import Any

from wasmtime.component import ResourceType

from pie.runtime.bindings.common import PACKAGE, Bindings, Kind, record
from pie.runtime.host import HostState


def register(root: Any, b: Bindings) -> None:
    def sample(st: HostState, store: Any, q: Any, emb: int, sampler: Any) -> Any:
        return st.own(Kind.FUTURE_TOKEN, st.session.sample(
            b.queue(st, store, q), emb, sampler.temperature, getattr(sampler, "top-k"),
            getattr(sampler, "top-p"), sampler.seed))

    with root.add_instance(PACKAGE.format("output-text")) as output_text:
        b.counted(output_text)
        output_text.add_resource("future-dist", ResourceType.host(Kind.FUTURE_DIST), b.drop)
        output_text.add_resource("future-token", ResourceType.host(Kind.FUTURE_TOKEN), b.drop)
        output_text.add_func("get-next-dist", b.call(lambda st, store, q, emb, k: st.own(
            Kind.FUTURE_DIST, st.session.get_next_dist(b.queue(st, store, q), emb, k))))
        output_text.add_func("sample", b.call(sample))
        output_text.add_func("[method]future-dist.subscribe", b.call(b.subscribe_to(Kind.FUTURE_DIST), False))
        output_text.add_func("[method]future-dist.get", b.call(b.future_getter(
            Kind.FUTURE_DIST,
            lambda f: b.tagged(f, lambda d: record(token_ids=d[0], probs=d[1]))), False))
        output_text.add_func("[method]future-token.subscribe", b.call(b.subscribe_to(Kind.FUTURE_TOKEN), False))
        output_text.add_func("[method]future-token.get",
                             b.call(b.future_getter(Kind.FUTURE_TOKEN, b.untagged), False))
