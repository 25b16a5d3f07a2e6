"""A token sequence and the KV pages that hold it (the Rust SDK's Context, in Python).

The committed tokens' K/V fill the pages in order, every page full but the last
(`last_len` slots); `pending` tokens are filled but not yet run. Full pages are shared by
forks; a page that may be shared (forked or imported) is copied before it is written.

A context that `set_discardable` lets the server drop its pages while the inferlet waits on
I/O and the KV pool runs short (`control.kv_pressure`); the next pass that names one fails
with `discarded`, and the context computes its committed tokens again and retries.
"""

from __future__ import annotations

import re

from wit_world.imports import allocate, forward, inference, input_text, kvs, memory

from inferlet.errors import Error, host
from inferlet.grammar import Grammar
from inferlet.model import Queue
from inferlet.sampling import Echo, Sampler, Stop
from inferlet.select import Selection, select
from inferlet.text_stream import TextStream


class Page:
    """A KV page, freed when no context holds it any more."""

    def __init__(self, queue: Queue, page_id: int, shared: bool = False):
        self.queue, self.id, self.shared = queue, page_id, shared

    def __del__(self):
        try:
            allocate.dealloc_kvpage(self.queue.raw, [self.id])
        except Exception:  # the instance is ending: the host reclaims everything anyway
            pass


class Context:
    """A token sequence (committed, then pending) and the KV pages that hold it."""
    def __init__(self, queue: Queue):
        self.queue = queue
        self.pages: list[Page] = []
        self.last_len = 0
        self.committed: list[int] = []
        self.pending: list[int] = []
        self._embeds: list[int] = []
        self._outputs: list[int] = []
        self._unclaimed: list[int] = []  # prefill passes whose result is not awaited
        self._discardable = False

    @property
    def tokens(self) -> list[int]:
        """Every token: committed, then pending."""
        return self.committed + self.pending

    def __len__(self) -> int:
        return len(self.committed) + len(self.pending)

    def set_discardable(self, on: bool = True) -> None:
        """Let the server drop this context's pages while the inferlet waits on I/O and the
        KV pool runs short (`memory.set-kv-class`; off: swappable, the default). A pass that
        then names a dropped page makes the context compute its committed tokens again and
        retry: worth it where the wait is long and the context short."""
        self._discardable = on
        if self.pages:
            kv_class = memory.KvClass.DISCARDABLE if on else memory.KvClass.SWAPPABLE
            host(memory.set_kv_class, [p.id for p in self.pages], kv_class)

    # --- input -----------------------------------------------------------------------------

    def fill(self, text: str) -> None:
        """Append `text`'s tokens as pending (run by the next pass)."""
        self.pending += self.queue.tokenize(text)

    def fill_tokens(self, tokens: list[int]) -> None:
        """Append `tokens` as pending."""
        self.pending += tokens

    def fill_chat(self, messages: list, add_generation_prompt: bool = True) -> None:
        """Append `messages` through the model's chat template (and the assistant's turn start)."""
        self.fill(self.queue.apply_chat_template(messages, add_generation_prompt))

    # --- running the model -----------------------------------------------------------------

    def flush(self) -> None:
        """Run every pending token but the last (which the next decode step needs)."""
        if len(self.pending) > 1:
            tokens, self.pending = self.pending[:-1], self.pending[-1:]
            self._execute(tokens, None)

    def forward_pending(self, indices: list[int]) -> list[int]:
        """Run all pending tokens; output embeds at `indices` (valid until the next forward)."""
        tokens, self.pending = self.pending, []
        if not indices:
            self._execute(tokens, None)
            return []
        return self._forward(tokens, indices)

    def decode_step(self, sampler: Sampler) -> int:
        """Run the pending tokens, draw the next token, leave it pending: one fused pass
        and one blocking take (two host calls)."""
        token = self._step(_output(sample=_pass_sampler(sampler))).tokens[0]
        self.pending.append(token)
        return token

    def next_dist(self, k: int) -> tuple[list[int], list[float]]:
        """Run the pending tokens; the k most likely next tokens (nothing is appended)."""
        (detail,) = self._step(_output(top_k=k)).details
        return list(detail.top_ids), list(detail.top_probs)

    def score(self, then: list[int], candidates: list[int]) -> list[float]:
        """Log-probabilities of `candidates` as the next token after the context's tokens
        (committed and pending) and `then` (as Rust's `Context::score`): one pass that
        writes no KV, so the context is unchanged (PrefillOnly's scoring path). `score_each`
        runs many at once."""
        return self.score_each([list(then)], candidates)[0]

    def score_each(self, thens: list[list[int]], candidates: list[int]) -> list[list[float]]:
        """`score` after each of `thens`: every pass enqueued before any is awaited, so they
        share batches (e.g. one per post after a flushed profile)."""
        if not candidates:
            raise Error("invalid-argument", "no candidate tokens to score")
        ids = [self._peek(then, _output(logprobs_of=candidates)) for then in thens]
        return [list(self._peeked(pass_id).details[0].logprobs) for pass_id in ids]

    def peek_next(self, sampler: Sampler, k: int) -> tuple[int, list[int], list[float]]:
        """Draw the next token after the pending ones, with the k most likely tokens and
        their probabilities, in one pass that writes no KV: the context is unchanged."""
        result = self._peeked(self._peek([], _output(sample=_pass_sampler(sampler), top_k=k)))
        (detail,) = result.details
        return result.tokens[0], list(detail.top_ids), list(detail.top_probs)

    def _peek(self, then: list[int], out) -> int:
        """Enqueue one pass over the pending tokens and `then` that writes no KV, `out` at
        the last of them; its id."""
        out.index = len(self.pending) + len(then) - 1
        return self._peek_outputs(then, [out])

    def _peek_outputs(self, then: list[int], outs: list) -> int:
        """`_peek` with `outs` at the indices they name."""
        tokens = self.pending + list(then)
        if not tokens:
            raise Error("invalid-argument", "nothing to predict from: fill the context or give tokens")
        start = len(self.committed)
        return host(inference.execute, self.queue.raw, inference.ForwardPass(
            input_embeds=[], input_tokens=tokens, positions=list(range(start, start + len(tokens))),
            input_kv_pages=[p.id for p in self.pages], input_kv_last_page_len=self.last_len,
            output_kv_pages=[], output_kv_offset=0, attention_mask=None,  # writes no KV
            outputs=outs, stop_tokens=[]))

    def _fresh_pass(self, tokens: list[int], outs: list) -> int:
        """A pass over `tokens` alone (no context, no KV written), on this queue; its id."""
        return host(inference.execute, self.queue.raw, inference.ForwardPass(
            input_embeds=[], input_tokens=tokens, positions=list(range(len(tokens))), input_kv_pages=[],
            input_kv_last_page_len=0, output_kv_pages=[], output_kv_offset=0, attention_mask=None,
            outputs=outs, stop_tokens=[]))

    def _peeked(self, pass_id: int):
        (result,) = _await(self.queue, pass_id)
        _check(result)
        return result

    def generate(self, sampler: Sampler, stop: Stop, grammar: Grammar | None = None,
                 echo: Echo | None = None) -> str:
        """Decode until `stop`; the text without the EOS token or the stop string.

        The decoding runs on the host (`inference.run`, at most RUN_STEPS steps a run): the
        next step is queued by the reply to the last, without waking this inferlet; tokens
        come back per step only when stop strings must be checked. With a `grammar`
        (compiled on this context's queue) every draw is masked to what it allows and the
        host advances it: Rust's `generate_constrained` / `run_constrained`; put the EOS
        tokens in `stop.eos`, the only tokens allowed once the grammar is complete. With
        `echo` the host also sends the text to the client as it is drawn (`Echo`; Rust's
        `Context::run_text`), one run of `stop.max_tokens` steps that ends at the token
        completing a stop string: the inferlet is not woken per token."""
        return self.start_generate(sampler, stop, grammar, echo).result()

    def start_generate(self, sampler: Sampler, stop: Stop, grammar: Grammar | None = None,
                       echo: Echo | None = None) -> Generation:
        """`generate` in two halves: this starts the host-side run and returns at once;
        `result()` waits for the text. Started on contexts of different queues, several
        generations decode together (their steps batch), as Rust's concurrent tasks do."""
        if not self.pending:
            raise Error("invalid-argument", "no pending token to predict from; fill the context first")
        if grammar is not None and grammar.queue is not self.queue:
            raise Error("invalid-argument", "the grammar was compiled on another queue than the context's")
        return Generation(self, sampler, stop, grammar, echo)

    def gen(self, max_tokens: int, regex: str | None = None, choices: list[str] | None = None,
            stop: list[str] = (), sampler: Sampler | None = None) -> str:  # type: ignore[assignment]
        """SGLang's `gen`: generate (greedy unless `sampler`) at most `max_tokens`, until EOS or
        a `stop` string, constrained to match `regex` or to be exactly one of `choices` if
        given (unlike `select`, which scores the choices). The text joins the context."""
        grammar = (Grammar.regex(self.queue, regex) if regex is not None
                   else Grammar.choices(self.queue, choices) if choices is not None else None)
        stopping = Stop(max_tokens, eos=self.queue.eos_tokens(), strings=list(stop))
        return self.generate(sampler or Sampler.greedy(), stopping, grammar)

    def fork_n(self, n: int) -> list[Context]:
        """`n` forks of this context (as Rust's `fork_n`), sharing its pages."""
        return [self.fork() for _ in range(n)]

    def select(self, choices: list[str], normalize: str = "mean") -> Selection:
        """Which of `choices` the model finds likeliest after the context (SGLang's
        `select`), scored in one batch of passes that write no KV; see `inferlet.select`."""
        return select(self, choices, normalize)

    # --- branching and reuse ---------------------------------------------------------------

    def fork(self, queue: Queue | None = None) -> Context:
        """A copy that can diverge: pages are shared, and copied before either side writes.
        With `queue` (another queue of this instance), its calls go there and run
        concurrently with this context's: call `self.queue.synchronize()` first."""
        for page in self.pages:
            page.shared = True
        other = Context(queue or self.queue)
        other.pages, other.last_len = list(self.pages), self.last_len
        other.committed, other.pending = list(self.committed), list(self.pending)
        other._discardable = self._discardable
        return other

    def truncate(self, length: int) -> None:
        """Forget every token from position `length` on."""
        if length >= len(self):
            return
        if length >= len(self.committed):
            self.pending = self.pending[: length - len(self.committed)]
            return
        self.pending, self.committed = [], self.committed[:length]
        ps = self.queue.page_size
        self.pages = self.pages[: (length + ps - 1) // ps]
        self.last_len = length - (len(self.pages) - 1) * ps if self.pages else 0

    def export(self, name: str, persistent: bool = False) -> None:
        """Publish the committed tokens' pages (and the tokens) under `name`, in the same
        record as the Rust SDK's `Context::export`, so either SDK can import it."""
        if not self.pages:
            raise Error("invalid-argument", "nothing to export: no committed tokens (flush first)")
        self.queue.synchronize()
        host(allocate.export_kvpage, [p.id for p in self.pages], name, persistent)
        for page in self.pages:
            page.shared = True  # read-only from now on: appending copies the last page
        ps = self.queue.page_size
        starts = ",".join(str(i * ps) for i in range(len(self.pages)))
        record = f"{self.last_len}|{starts}|{','.join(map(str, self.committed))}"
        host(kvs.store_set, _export_key(name), record)

    @staticmethod
    def imported(queue: Queue, name: str) -> Context | None:
        """A context over an export's pages and tokens, or None if there is no such export."""
        record = kvs.store_get(_export_key(name))
        if record is None:
            return None
        try:
            ids = host(allocate.import_kvpage, name)
        except Error as e:
            if e.kind == "not-found":
                return None
            raise
        last_len, starts, tokens = record.split("|", 2)  # the Rust SDK's format too
        ps = queue.page_size
        if [int(s) for s in starts.split(",") if s] != [i * ps for i in range(len(ids))]:
            raise Error("unsupported", f"export {name!r} has dropped pages (attention sink or "
                                       "window), which the Python SDK cannot hold")
        ctx = Context(queue)
        ctx.committed = [int(t) for t in tokens.split(",") if t]
        ctx.pages = [Page(queue, i, shared=True) for i in ids]
        ctx.last_len = int(last_len)
        return ctx

    @staticmethod
    def unexport(name: str) -> None:
        """Remove an export made by `export` (pages already imported stay valid)."""
        kvs.store_delete(_export_key(name))
        host(allocate.unexport_kvpage, name)

    # --- internals -------------------------------------------------------------------------

    def _start_run(self, sampler: Sampler, steps: int, stop_tokens: list[int], streaming: bool, mask=None,
                   echo=None):
        """A host-side run from the pending tokens (a long prompt prefilled first, in chunks
        of the host's limit, learnt from its refusal), `run-text` with an `echo` record:
        (its input tokens, its id, its pages)."""
        tokens, self.pending = self.pending, []
        recomputed = False
        while True:
            if len(tokens) > _chunk_limit:  # a long prompt: prefill all but the end first
                try:
                    self._execute(tokens[:-1], None)
                except Error:
                    self.pending = tokens
                    raise
                tokens = tokens[-1:]
            out = _output(index=len(tokens) - 1, sample=_pass_sampler(sampler), grammar=mask)
            try:
                record, new = self._pass_over(tokens, len(tokens) + steps - 1, [out], stop_tokens)
                started = (host(inference.run, self.queue.raw, record, steps, streaming) if echo is None
                           else host(inference.run_text, self.queue.raw, record, steps, echo))
                return tokens, started, new
            except Error as e:
                if self._lost(e) and not recomputed:
                    recomputed = True
                    self._recompute()
                    continue
                if not _learn_limit(e, len(tokens)):
                    self.pending = tokens
                    raise

    def _step(self, out) -> object:
        """Run every pending token with `out` at the last; its (final) result."""
        if not self.pending:
            raise Error("invalid-argument", "no pending token to predict from; fill the context first")
        tokens, self.pending = self.pending, []
        out.index = len(tokens) - 1
        pass_id = self._execute(tokens, out)
        (result,) = _await(self.queue, pass_id)
        self._claim_unclaimed()
        _check(result)
        return result

    def _execute(self, tokens: list[int], out) -> int:
        """Fused passes over `tokens` (chunks of at most max_batch_tokens), `out` at the
        last; earlier chunks' results are claimed later. The last pass's id."""
        start, recomputed = 0, False
        while True:
            end = min(len(tokens), start + max(1, _chunk_limit))
            last = end == len(tokens)
            outputs = []
            if out is not None and last:
                out.index -= start
                outputs = [out]
            try:
                record, new = self._pass_over(tokens[start:end], end - start, outputs, [])
                pass_id = host(inference.execute, self.queue.raw, record)
            except Error as e:
                size = end - start
                if out is not None and last:
                    out.index += start
                if self._lost(e) and not recomputed:
                    recomputed = True
                    self._recompute()
                elif not _learn_limit(e, size):
                    raise
                continue
            self._commit(tokens[start:end], new)
            if last:
                return pass_id
            self._unclaimed.append(pass_id)
            start = end

    def _pass_over(self, tokens: list[int], room: int, outputs: list, stop_tokens: list[int]):
        """The pass record writing `tokens` after the committed ones, into pages with room
        for `room` tokens; and the new pages (kept by `_commit` as far as used)."""
        ps = self.queue.page_size
        free = ps - self.last_len if self.pages else 0
        if free and self.pages[-1].shared:
            self._copy_last_page()
        need = -(-max(0, room - free) // ps)
        new = self._alloc(need)
        start = len(self.committed)
        record = inference.ForwardPass(
            input_embeds=[], input_tokens=list(tokens), positions=list(range(start, start + len(tokens))),
            input_kv_pages=[p.id for p in self.pages], input_kv_last_page_len=self.last_len,
            output_kv_pages=([self.pages[-1].id] if free else []) + [p.id for p in new],
            output_kv_offset=self.last_len if free else 0, attention_mask=None,
            outputs=outputs, stop_tokens=stop_tokens)
        return record, new

    def _commit(self, tokens: list[int], new: list[Page]) -> None:
        """`tokens` were written after the committed ones; keep the new pages they reached."""
        ps = self.queue.page_size
        free = ps - self.last_len if self.pages else 0
        self.pages += new[: -(-max(0, len(tokens) - free) // ps)]
        self.committed += tokens
        if self.pages:
            self.last_len = len(self.committed) - (len(self.pages) - 1) * ps

    def _claim_unclaimed(self) -> None:
        failures = [r for pass_id in self._unclaimed for r in _RESULTS.pop(pass_id, [])
                    if _status(r) == "failed"]
        self._unclaimed = [i for i in self._unclaimed if i in _RESULTS]
        if failures:
            _check(failures[0])

    def _forward(self, tokens: list[int], indices: list[int]) -> list[int]:
        """Run `tokens`, in chunks of at most the backend's max_batch_tokens (one pass when
        they fit); output embeds at `indices` (positions in `tokens`)."""
        if not tokens:
            return []
        q = self.queue
        if len(self._outputs) < len(indices):
            self._outputs += host(allocate.alloc_emb, q.raw, len(indices) - len(self._outputs))
        outputs = self._outputs[: len(indices)]
        start, recomputed = 0, False
        while start < len(tokens):
            end = min(len(tokens), start + max(1, _chunk_limit))
            chunk = [(i - start, out) for i, out in zip(indices, outputs) if start <= i < end]
            try:
                self._forward_chunk(tokens[start:end], [i for i, _ in chunk], [out for _, out in chunk])
            except Error as e:
                # The host refused the chunk before running anything: learn its limit, retry.
                size = end - start
                if self._lost(e) and not recomputed:
                    recomputed = True
                    self._recompute()
                elif not _learn_limit(e, size):
                    raise
                continue
            start = end
        return outputs

    def _forward_chunk(self, tokens: list[int], indices: list[int], outputs: list[int]) -> None:
        """One forward pass; fails before changing anything if the host refuses the embedding."""
        q, n, ps = self.queue, len(tokens), self.queue.page_size
        if len(self._embeds) < n:
            self._embeds += host(allocate.alloc_emb, q.raw, n - len(self._embeds))
        start = len(self.committed)
        host(input_text.embed_text, q.raw, tokens, list(range(start, start + n)), self._embeds[:n])
        free = ps - self.last_len if self.pages else 0
        if free and self.pages[-1].shared:
            self._copy_last_page()
        new = self._alloc(-(-max(0, n - free) // ps))
        out_pages = ([self.pages[-1].id] if free else []) + [p.id for p in new]
        host(forward.forward, q.raw, forward.ForwardPass(
            input_kv_pages=[p.id for p in self.pages], input_kv_last_page_len=self.last_len,
            input_embeds=self._embeds[:n], output_kv_pages=out_pages,
            output_kv_offset=self.last_len if free else 0, output_embeds=outputs,
            output_token_indices=list(indices), attention_mask=None))
        self.pages += new
        self.committed += tokens
        self.last_len = len(self.committed) - (len(self.pages) - 1) * ps
        if len(self._embeds) > KEPT_EMBEDS:  # a prefill's embeds: not needed for decoding
            host(allocate.dealloc_emb, q.raw, self._embeds[KEPT_EMBEDS:])
            del self._embeds[KEPT_EMBEDS:]

    def _copy_last_page(self) -> None:
        (copy,) = self._alloc(1)
        host(allocate.copy_kvpage, self.queue.raw, self.pages[-1].id, copy.id, 0, 0, self.last_len)
        self.pages[-1] = copy

    def _alloc(self, count: int) -> list[Page]:
        if not count:
            return []
        pages = [Page(self.queue, i) for i in host(allocate.alloc_kvpage, self.queue.raw, count)]
        if self._discardable:
            host(memory.set_kv_class, [p.id for p in pages], memory.KvClass.DISCARDABLE)
        return pages

    def _lost(self, e: Error) -> bool:
        """The server dropped pages of this discardable context (`set_discardable`)."""
        return self._discardable and e.kind == "discarded"

    def _recompute(self) -> None:
        """Compute the committed tokens again into new pages (their old ones were dropped):
        chunked passes, claimed at the next await like a prefill's."""
        tokens, self.committed, self.pages, self.last_len = self.committed, [], [], 0
        if tokens:
            self._unclaimed.append(self._execute(tokens, None))

    def __del__(self):
        embeds = self._embeds + self._outputs
        if embeds:
            try:
                allocate.dealloc_emb(self.queue.raw, embeds)
            except Exception:
                pass


KEPT_EMBEDS = 16  # input embeds a context keeps between forwards
RUN_STEPS = 256  # the most steps of one host-side run: its pages are reserved up front

# Results taken from the host but not yet claimed, by pass id (pass ids are per instance).
_RESULTS: dict[int, list] = {}


class Generation:
    """A `Context.start_generate` in progress: one host-side run at a time (RUN_STEPS steps
    at most), the next started when one ends short of `stop`. With an `Echo`, one run of
    every step: the host looks for the stop strings in its text, so it must see it whole."""

    def __init__(self, ctx: Context, sampler: Sampler, stop: Stop, grammar: Grammar | None = None,
                 echo: Echo | None = None):
        self.ctx, self.sampler, self.stop = ctx, sampler, stop
        self.echo = None if echo is None else echo.to_host(stop)
        self.mask = None if grammar is None else inference.GrammarMask(matcher=grammar.id(), advance=True)
        self.generated: list[int] = []
        self.text = TextStream(ctx.queue)  # what stop strings are looked for in
        self.seed = sampler.seed
        self.run = self._start() if stop.max_tokens > 0 else None

    def _start(self):
        steps = self.stop.max_tokens - len(self.generated)
        if self.echo is None:
            steps = min(steps, RUN_STEPS)
        # With an echo nothing streams back: the host sends the text and watches the strings.
        streaming = self.echo is None and bool(self.stop.strings)
        return self.ctx._start_run(self.sampler.with_seed(self.seed), steps, list(self.stop.eos),
                                   streaming, self.mask, self.echo)

    def result(self) -> str:
        """The generated text (blocking until the decoding ends)."""
        ctx, stop, generated = self.ctx, self.stop, self.generated
        while self.run is not None:
            tokens, pass_id, new = self.run
            drawn: list[int] = []
            cut, status = None, "running"
            while status == "running":
                for result in _await(ctx.queue, pass_id):
                    drawn += result.tokens
                    status = _status(result)
                    _check(result)
                if cut is None and stop.strings:
                    visible = []
                    for t in generated + drawn:
                        if t in stop.eos:
                            break
                        visible.append(t)
                    self.text.push(visible[len(self.text.tokens):])
                    cut = stop.cut(self.text.text)
                    if cut is not None and status == "running":
                        host(inference.cancel, ctx.queue.raw, pass_id)
            ctx._claim_unclaimed()
            ctx._commit(tokens + drawn[:-1], new)  # all but the last drawn token were fed back
            ctx.pending = drawn[-1:]
            self.seed = None if self.seed is None else self.seed + len(drawn)
            if cut is not None:
                return cut
            for token in drawn:
                if token in stop.eos:
                    return ctx.queue.detokenize(generated)
                generated.append(token)
            self.run = self._start() if len(generated) < stop.max_tokens else None
        return ctx.queue.detokenize(generated)


def _output(index: int = 0, sample=None, top_k: int = 0, logprobs_of: list[int] = (),  # type: ignore[assignment]
            grammar=None):
    return inference.Output(index=index, sample=sample, top_k=top_k, logprobs_of=list(logprobs_of),
                            entropy=False, allowed=None, grammar=grammar, rules=None, keep=None)


def _logprobs(result) -> list[float]:
    """The `logprobs_of` of each of a pass's outputs, in output order (one id each)."""
    return [d.logprobs[0] for d in sorted(result.details, key=lambda d: d.index)]


def _pass_sampler(s: Sampler):
    return inference.Sampler(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=0.0,
                             seed=s.seed)


def _pass_id(result) -> int:
    return getattr(result, "pass_", None) if hasattr(result, "pass_") else getattr(result, "pass")


def _status(result) -> str:
    return result.status.name.lower()


def _check(result) -> None:
    if _status(result) == "failed":
        failure = result.failure
        raise Error.from_host(failure) if failure is not None else Error("inference-failed", "pass failed")


def _await(queue: Queue, pass_id: int) -> list:
    """The next results of `pass_id` (a run's progress, or a pass's final result): blocking
    takes on its queue, other passes' results kept for their owners."""
    while pass_id not in _RESULTS:
        got = inference.take(queue.raw, True)
        if not got:
            raise Error("inference-failed", f"pass {pass_id} is awaited but nothing is in flight on its queue")
        for result in got:
            _RESULTS.setdefault(_pass_id(result), []).append(result)
    return _RESULTS.pop(pass_id)

# The most tokens a Context runs in one forward pass. The host API does not tell the
# backend's max_batch_tokens, so this starts at its default (4096: a prompt that fits runs in
# one pass, exactly as unchunked) and drops to the host's limit the first time the host
# refuses a pass as too long (its error names the limit). One per instance.
_chunk_limit = 4096
_LIMIT_NAME = "max_batch_tokens"


def _learn_limit(e: Error, size: int) -> bool:
    """If the host refused `size` tokens as too many, remember its limit (from its message,
    or half) and say so."""
    global _chunk_limit
    if size == 1 or e.kind != "invalid-argument" or _LIMIT_NAME not in e.message:
        return False
    told = re.search(_LIMIT_NAME + r"\D*(\d+)", e.message)
    _chunk_limit = min(size - 1, max(1, int(told.group(1)) if told else size // 2))
    return True


def _export_key(name: str) -> str:
    return f"pie.context-export.{name}"
