"""`grammar`: compiled grammars (llguidance matchers) and grammar-constrained sampling."""

from __future__ import annotations

from typing import Any

from wasmtime.component import ResourceType

from pie.runtime.bindings.common import PACKAGE, Bindings, Kind
from pie.runtime.host import HostState

_QUERIES = (("allowed-tokens", "allowed_tokens"), ("forced-tokens", "forced_tokens"),
            ("is-accepting", "is_accepting"), ("is-stopped", "is_stopped"))


def register(root: Any, b: Bindings) -> None:
    def matcher(st: HostState, store: Any, m: Any) -> Any:
        return st.get(store, m, Kind.MATCHER)

    # A matcher keeps the queue it was compiled on: wasmtime-py 50 cannot take two borrows
    # in one host call ("deferred host scope has no call context").
    def compile_grammar(st: HostState, store: Any, q: Any, kind: str, source: str) -> Any:
        q = b.queue(st, store, q)
        return st.own(Kind.MATCHER, (q, st.session.compile_grammar(q, kind, source)))

    def constrained_sample(st: HostState, store: Any, m: Any, emb: int, sampler: Any) -> Any:
        q, grammar_matcher = matcher(st, store, m)
        return st.own(Kind.FUTURE_TOKEN, st.session.sample(
            q, emb, sampler.temperature, getattr(sampler, "top-k"),
            getattr(sampler, "top-p"), sampler.seed, grammar_matcher))

    with root.add_instance(PACKAGE.format("grammar")) as grammar:
        b.counted(grammar)
        grammar.add_resource("matcher", ResourceType.host(Kind.MATCHER), b.drop)
        grammar.add_func("compile", b.call(compile_grammar))
        grammar.add_func("[method]matcher.sample", b.call(constrained_sample))
        grammar.add_func("[method]matcher.accept",
                         b.call(lambda st, store, m, tokens: matcher(st, store, m)[1].accept(list(tokens))))
        grammar.add_func("[method]matcher.rollback",
                         b.call(lambda st, store, m, n: matcher(st, store, m)[1].rollback(n)))
        grammar.add_func("[method]matcher.id", b.call(lambda st, store, m: matcher(st, store, m)[1].id, False))
        for name, method in _QUERIES:
            grammar.add_func(f"[method]matcher.{name}", b.call(
                lambda st, store, m, method=method: getattr(matcher(st, store, m)[1], method)(), False))
