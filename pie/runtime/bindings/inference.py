"""`inference`: the fused pass, host-side decode runs, and their results (sdk/wit/inference.wit).

A WIT `forward-pass` record becomes one `pie.control.passes.Pass` here and nowhere else;
results go back as flat records, one per pass, with no resource made per pass or token.
"""

from __future__ import annotations

from array import array
from typing import Any

from pie.control.logit_rules import LogitRules
from pie.control.passes import Output
from pie.control.text_echo import TextEcho
from pie.runtime.bindings.common import PACKAGE, Bindings, Kind, error_record, record
from pie.runtime.host import HostState, Terminated


def _output(o: Any) -> Output:
    sampler, grammar, allowed = o.sample, o.grammar, o.allowed
    out = Output(index=o.index, dist_k=getattr(o, "top-k"), logprob_ids=list(getattr(o, "logprobs-of")),
                 entropy=o.entropy, keep=-1 if o.keep is None else o.keep,
                 allowed=None if allowed is None else array("I", allowed).tobytes())
    if sampler is not None:
        out.sample, out.temperature = True, sampler.temperature
        out.top_k, out.top_p = getattr(sampler, "top-k"), getattr(sampler, "top-p")
        out.min_p = getattr(sampler, "min-p")
        out.seed = -1 if sampler.seed is None else sampler.seed % (1 << 63)
    if grammar is not None:
        out.matcher_id, out.advance = grammar.matcher, grammar.advance
    rules = o.rules
    if rules is not None:
        out.rules = LogitRules.of(rules.bias, getattr(rules, "presence-penalty"), getattr(rules, "frequency-penalty"),
                                  rules.seen, rules.banned, getattr(rules, "banned-until"))
    return out


def _submit(st: HostState, q: Any, p: Any, run_steps: int | None, stream: bool = True,
            echo: TextEcho | None = None) -> int:
    mask = getattr(p, "attention-mask")
    return st.session.submit_pass(
        q, run_steps, stream=stream, echo=echo, token_ids=getattr(p, "input-tokens"), positions=p.positions,
        embeds=getattr(p, "input-embeds"), kv_pages=getattr(p, "input-kv-pages"),
        last_len=getattr(p, "input-kv-last-page-len"), out_pages=getattr(p, "output-kv-pages"),
        out_offset=getattr(p, "output-kv-offset"), mask=None if mask is None else bytes(mask),
        outputs=[_output(o) for o in p.outputs], stop_tokens=getattr(p, "stop-tokens"))


def _echo(st: HostState, tokenizer: Any, e: Any) -> TextEcho:
    """`text-echo`: the run's text goes out as the instance's messages, from the scheduler
    thread (no pacing or back-pressure: a message per drawn token at most)."""
    return TextEcho(tokenizer, st.send_message, e.prefix, e.suffix, e.json, list(getattr(e, "stop-strings")),
                    list(e.hidden))


def _result(pass_id: int, status: str, tokens: list[int], details: list[dict], error: Any) -> Any:
    out = record(
        status=str(status), tokens=tokens,
        details=[record(index=d["index"], top_ids=d["top_ids"], top_probs=d["top_probs"],
                        logprobs=d["logprobs"], entropy=d["entropy"]) for d in details],
        failure=None if error is None else error_record(error))
    setattr(out, "pass", pass_id)  # a Python keyword
    return out


def register(root: Any, b: Bindings) -> None:
    with root.add_instance(PACKAGE.format("inference")) as inference:
        b.counted(inference)
        inference.add_func("execute", b.call(
            lambda st, store, q, p: _submit(st, b.queue(st, store, q), p, None)))
        inference.add_func("run", b.call(
            lambda st, store, q, p, steps, stream: _submit(st, b.queue(st, store, q), p, steps, stream)))
        inference.add_func("run-text", b.call(
            lambda st, store, q, p, steps, e: _submit(st, b.queue(st, store, q), p, steps, False,
                                                      _echo(st, b.controller.tokenizer.tokenizer, e))))

        def take(st: HostState, store: Any, q: Any, block: bool) -> list[Any]:
            taken = st.session.take(b.queue(st, store, q), block, st.cancelled)
            if st.cancelled.is_set():
                raise Terminated("instance terminated")
            return [_result(*t) for t in taken]

        inference.add_func("take", b.call(take, False))
        inference.add_func("results-ready", b.call(
            lambda st, store, q: st.own(Kind.POLLABLE, st.session.results_ready(b.queue(st, store, q))), False))
        inference.add_func("cancel", b.call(
            lambda st, store, q, pass_id: st.session.cancel_pass(b.queue(st, store, q), pass_id)))
