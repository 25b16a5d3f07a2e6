"""The fused pass (`inference.execute` / `inference.run`): one typed object from the host
binding to the wire.

A `Pass` is made by the binding with physical ids, checked once by `Pass.validate`,
queued on its `CommandQueue` like a `Command`, packed with its batch into one
`protocol.Passes` request by `encode`, and settled by `settle` on the scheduler thread. A
host-side run is one `Pass` that `settle` advances by itself (`Pass.advance`) and puts back
at the head of its queue, so the next step leaves in the batch right after the reply,
without waking the inferlet (docs/fused-pass.md §2.4, §3). Results reach the inferlet
through its queue's `PassResults` (`take`, `results-ready`), not one future per pass.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from array import array
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from pie import protocol as P
from pie.control.errors import ErrorKind, HostError
from pie.control.grammar import Matcher
from pie.control.logit_rules import LogitRules

if TYPE_CHECKING:
    from pie.control.command import CommandQueue
    from pie.control.text_echo import TextEcho


class Status(StrEnum):
    """`inference.pass-status`, by its WIT case names."""

    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


@dataclass(slots=True, eq=False)
class Output:
    """What one output row computes (`inference.output`), with physical ids."""

    index: int
    sample: bool = False
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = -1  # -1: the backend's generator
    dist_k: int = 0
    logprob_ids: list[int] = field(default_factory=list)
    entropy: bool = False
    allowed: bytes | None = None
    matcher: Matcher | None = None
    advance: bool = False  # accept the drawn token into `matcher` on the reply
    matcher_id: int = 0  # as the guest named it (`matcher.id`); the session resolves it
    keep: int = -1  # physical embed that also receives the hidden state
    rules: LogitRules | None = None  # bias, penalties, bans (a run's draws update it)


@dataclass(frozen=True)
class Limits:
    """What `Pass.validate` checks against (from the handshake and the config)."""

    page_size: int
    vocab_size: int
    max_batch_tokens: int
    max_dist_k: int
    context_length: int = 0  # the model's max_position_embeddings (0: not known, not checked)


def _invalid(message: str) -> HostError:
    return HostError(ErrorKind.INVALID_ARGUMENT, message)


@dataclass(slots=True, eq=False)
class Pass:
    """One fused pass, or the current step of a host-side run (`steps_left` > 1)."""

    queue: CommandQueue
    pass_id: int
    page_size: int
    token_ids: list[int]
    positions: list[int]
    embeds: list[int]  # physical input embeds (new tokens before token_ids)
    kv_pages: list[int]  # physical
    last_len: int
    out_pages: list[int]  # physical, writable
    out_offset: int
    mask: bytes | None
    outputs: list[Output]
    stop_tokens: frozenset[int] = frozenset()
    stream: bool = True  # a run reports each step's token (else once, at its end)
    stream_every: int = 1  # a streaming run wakes its taker once per this many tokens (control.stream_interval)
    echo: TextEcho | None = None  # a run that sends its own text (`inference.run-text`)
    steps_left: int = 1
    kind: str = P.Kind.PASS  # what the scheduler batches by
    tokens: int = 0  # new tokens: counts toward max_batch_tokens
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()
    enqueued: float = 0.0
    on_head: None = None  # (the scheduler's Command protocol: passes are never markers,
    future: None = None  # and their results go through queue.results, not a future)
    # Results, guarded by queue.results.lock once the pass is submitted.
    status: Status = Status.RUNNING
    fresh: list[int] = field(default_factory=list)  # drawn tokens not yet taken
    details: list[dict[str, Any]] = field(default_factory=list)
    error: HostError | None = None
    cancelled: bool = False  # asked to stop (a run stops after the step in flight)
    listed: bool = False  # in queue.results.ready
    taken: int = 0  # tokens the instance has taken (its thread only; usage accounting)
    # A run's own bookkeeping: every page it may use in order, slots filled, last position.
    run_pages: list[int] = field(default_factory=list)
    filled: int = 0
    last_position: int = 0
    parent: Pass | None = None  # a chunk (see `split`): its results are not published
    index_base: int = 0  # leading new tokens cut off (chunks, cached pages): add to result indices
    # The prefix cache's view (pie/control/prefix_cache.py): the user it is scoped to; the
    # tokens at positions [prefix_base, context + new) where known (a pass from the start or
    # continuing recorded pages, then its chunks and run steps) and the page hashes so far;
    # cached pages copied in before the forward (cache page, own page); own pages copied out
    # after it (key, own page, cache page); when last sent, the stamp of its writes and the
    # first page index they cover.
    scope: str = ""
    prefix: list[int] | None = None
    prefix_base: int = 0  # the slot `prefix` starts at (the pages before it: `chain`)
    chain: list[bytes] = field(default_factory=list)
    copy_in: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[tuple[str, bytes], int, int]] = field(default_factory=list)
    cache: Any = None  # the PrefixCache that planned copy_in / saves, told when this settles
    cache_checked: bool = False
    stamp: int = 0
    written_from: int = 0
    deferred: bool = False  # held back once for a page another pass was computing
    cached_tokens: int = 0  # tokens whose KV the prefix cache copied in instead of computing
    dropped: bool = False  # failed before or while it ran: nothing more is planned for it
    # A scoring pass served in place (`PrefixCache._serve_in_place`): cache pages it reads as
    # its context, pages it fills for the cache (key, page), pages it writes and drops.
    in_place: bool = False
    borrowed: list[int] = field(default_factory=list)
    fills: list[tuple[tuple[str, bytes], int]] = field(default_factory=list)
    temp: list[int] = field(default_factory=list)

    @property
    def owner(self) -> Pass:
        """The pass the guest knows: a chunk's parent, or this pass."""
        return self.parent or self

    def __post_init__(self) -> None:
        self._derive()

    def _derive(self, enqueued: float | None = None) -> None:
        self.tokens = len(self.embeds) + len(self.token_ids)
        keep = [o.keep for o in self.outputs if o.keep >= 0]
        self.reads = frozenset([("p", p) for p in self.kv_pages] + [("e", e) for e in self.embeds])
        self.writes = frozenset([("p", p) for p in self.out_pages] + [("e", e) for e in keep])
        self.enqueued = time.monotonic() if enqueued is None else enqueued

    # --- checks at the call ---------------------------------------------------------------

    def validate(self, limits: Limits, run_steps: int | None = None) -> None:
        """Every semantic check of a pass, once, at the call (HostError names the field);
        with `run_steps`, of a run's first step. The backend keeps only bounds checks: any
        ZeroMQ peer can reach it."""
        ps, vocab, n_new = limits.page_size, limits.vocab_size, self.tokens
        if n_new == 0:
            raise _invalid("a pass needs at least one new token (input-embeds or input-tokens)")
        if n_new > limits.max_batch_tokens:
            raise _invalid(f"{n_new} tokens in one call exceed the backend's max_batch_tokens = "
                           f"{limits.max_batch_tokens}; split the call into chunks")
        if len(self.positions) != len(self.token_ids):
            raise _invalid(f"{len(self.token_ids)} input tokens but {len(self.positions)} positions")
        for i, t in enumerate(self.token_ids):
            if t >= vocab:
                raise _invalid(f"input token {i} is {t}, not below the vocabulary size {vocab}")
        last = max(self.positions, default=0) + (run_steps - 1 if run_steps else 0)
        if limits.context_length and last >= limits.context_length:
            raise _invalid(f"position {last} is past the model's context length {limits.context_length} "
                           f"(positions 0..{limits.context_length - 1}); the input is too long")
        if self.kv_pages and not 1 <= self.last_len <= ps:
            raise _invalid(f"input-kv-last-page-len {self.last_len} must be in [1, {ps}]")
        if self.out_pages and (self.out_offset >= ps or len(self.out_pages) * ps - self.out_offset < n_new):
            raise _invalid(f"output pages from offset {self.out_offset} hold "
                           f"{max(0, len(self.out_pages) * ps - self.out_offset)} slots, {n_new} needed")
        n_keys = self.context_slots() + n_new
        if self.mask is not None and len(self.mask) != math.ceil(n_new * n_keys / 8):
            raise _invalid(f"attention mask must be {math.ceil(n_new * n_keys / 8)} bytes "
                           f"(packed bits of {n_new} x {n_keys}), got {len(self.mask)}")
        seen: set[int] = set()
        words = (vocab + 31) // 32
        for o in self.outputs:
            if o.index >= n_new or o.index in seen:
                raise _invalid(f"output index {o.index} is out of range [0, {n_new}) or repeated")
            seen.add(o.index)
            if o.sample:
                if not (math.isfinite(o.temperature) and o.temperature >= 0):
                    raise _invalid(f"temperature {o.temperature} must be a finite number >= 0")
                if not 0 < o.top_p <= 1:
                    raise _invalid(f"top-p {o.top_p} must be in (0, 1]")
                if not 0 <= o.min_p <= 1:
                    raise _invalid(f"min-p {o.min_p} must be in [0, 1]")
            if o.dist_k > limits.max_dist_k:
                raise _invalid(f"top-k {o.dist_k} is over control.max_dist_k = {limits.max_dist_k}")
            if any(t >= vocab for t in o.logprob_ids):
                raise _invalid(f"a logprobs-of id is not below the vocabulary size {vocab}")
            if o.allowed is not None and len(o.allowed) != 4 * words:
                raise _invalid(f"allowed must be {words} words (ceil(vocab / 32)), "
                               f"got {len(o.allowed) // 4}")
            if o.rules is not None:
                o.rules.validate(vocab, limits.context_length or 1 << 20)
        if run_steps is not None:
            self._validate_run(ps, run_steps)

    def context_slots(self) -> int:
        return (len(self.kv_pages) - 1) * self.page_size + self.last_len if self.kv_pages else 0

    def slot_pages(self) -> list[int]:
        """The pages holding slots 0, 1, ... of this pass's sequence: the context's, then
        the output pages beyond a partial last context page."""
        partial = bool(self.kv_pages) and self.last_len < self.page_size
        return self.kv_pages + (self.out_pages[1:] if partial else self.out_pages)

    def continues(self) -> bool:
        """The output slots continue the context: the partial last input page first, from its
        length, or offset 0 after a full page or no context; every further page fresh. The
        layout `fill` and `run` use, which chunking and the prefix cache rely on."""
        if not self.out_pages:
            return False
        partial = bool(self.kv_pages) and self.last_len < self.page_size
        if partial and (self.out_pages[0] != self.kv_pages[-1] or self.out_offset != self.last_len):
            return False
        fresh = self.out_pages[1:] if partial else self.out_pages
        return (partial or self.out_offset == 0) and not set(fresh) & set(self.kv_pages)

    def tokens_only(self) -> bool:
        """New tokens only, at the positions right after the context, no custom mask, in
        slots that continue it: what the prefix cache can name by tokens (with the
        context's, pie/control/prefix_cache.py)."""
        context = self.context_slots()
        return (not self.embeds and self.mask is None and self.continues()
                and self.positions == list(range(context, context + len(self.token_ids))))

    def scores_from_start(self) -> bool:
        """Tokens from position 0 with no context, no mask, and no KV written: a scoring
        pass (`Context::score` after an unflushed fill, `/v1/completions` with
        `max_tokens: 1`), which the prefix cache serves in place."""
        return (not self.kv_pages and not self.out_pages and not self.embeds and self.mask is None
                and self.steps_left == 1 and self.positions == list(range(len(self.token_ids))))

    def before_output(self) -> int:
        """How many leading new tokens come before the first output (at least the last
        one is computed): what a chunk or the prefix cache may take off the pass."""
        return min(min((o.index for o in self.outputs), default=self.tokens), self.tokens - 1)

    def read_in_place(self, context: list[int], out_pages: list[int]) -> None:
        """Take `context`, full pages holding this pass's first tokens, as its context
        instead of computing them, and write the rest's keys and values to `out_pages` from
        offset 0 (none: to no page). Results keep the indices the guest gave."""
        n = len(context) * self.page_size
        self.kv_pages, self.last_len = context, self.page_size
        self.out_pages, self.out_offset = out_pages, 0
        self.token_ids, self.positions = self.token_ids[n:], self.positions[n:]
        for o in self.outputs:
            o.index -= n
        self.index_base += n
        self._derive(self.enqueued)

    def _validate_run(self, ps: int, steps: int) -> None:
        if steps < 1:
            raise _invalid("steps must be at least 1")
        last = self.tokens - 1
        if len(self.outputs) != 1 or not self.outputs[0].sample or self.outputs[0].index != last:
            raise _invalid(f"a run's pass needs exactly one output, with a sampler, at its last "
                           f"new token (index {last})")
        partial = bool(self.kv_pages) and self.last_len < ps
        fresh = self.out_pages[1:] if partial else self.out_pages
        if not self.continues():
            raise _invalid(f"a run's output pages must continue the context: the partial last "
                           f"input page first from offset {self.last_len}, or offset 0 after a "
                           f"full page, then new pages")
        if len(set(fresh)) != len(fresh):
            raise _invalid("a run's output pages must be new pages, each once")
        room = len(self.out_pages) * ps - self.out_offset
        if room < self.tokens + steps - 1:
            raise _invalid(f"output pages hold {room} slots from the offset; the run needs "
                           f"{self.tokens + steps - 1} (n-new + steps - 1)")
        self.run_pages = self.kv_pages + fresh
        self.filled = self.context_slots()
        self.last_position = max(self.positions) if self.positions else 0
        self.steps_left = steps

    # --- chunked prefill ------------------------------------------------------------------

    def chunkable(self) -> int:
        """How many leading new tokens may go ahead as a chunk (0: none): those before the
        first output, when the output slots continue the context (the partial last input
        page first from its length, or offset 0 after a full page or no context, every
        further page fresh) and there is no custom mask — the layout `fill` and `run` use."""
        if self.mask is not None or not self.continues():
            return 0
        return self.before_output()

    def split(self, n: int) -> Pass:
        """Cut off the first `n` new tokens (n <= `chunkable()`) as a chunk that runs now,
        writing their keys/values and computing nothing else; this pass keeps the rest,
        its context extended by the chunk. Results, errors and cancellation stay this
        pass's: the chunk only names it as its `parent`."""
        ps = self.page_size
        embeds, tokens = self.embeds[:n], self.token_ids[:max(0, n - len(self.embeds))]
        chunk = Pass(self.queue, self.pass_id, ps, tokens, self.positions[:len(tokens)], embeds,
                     self.kv_pages, self.last_len, self.out_pages, self.out_offset, None, [],
                     parent=self, scope=self.scope, cache_checked=self.cache_checked)
        context = self.context_slots()
        if self.prefix is not None:
            chunk.prefix, chunk.chain = self.prefix[:context + n - self.prefix_base], list(self.chain)
            chunk.prefix_base = self.prefix_base
        chunk.copy_in, self.copy_in = self.copy_in, []  # cached pages go in before the first chunk
        chunk.cache = self.cache
        pages = self.slot_pages()
        filled = context + n
        n_pages = math.ceil(filled / ps)
        self.kv_pages, self.last_len = pages[:n_pages], filled - (n_pages - 1) * ps
        self.out_pages, self.out_offset = pages[filled // ps:], filled % ps
        self.embeds = self.embeds[len(embeds):]
        self.token_ids, self.positions = self.token_ids[len(tokens):], self.positions[len(tokens):]
        for o in self.outputs:
            o.index -= n
        self.index_base += n
        self.filled += n  # a run counts the chunk as context of its first step
        self._derive(self.enqueued)
        return chunk

    # --- a run's next step ----------------------------------------------------------------

    def ahead(self, limit: int) -> int:
        """How many steps after this one the backend may take on its own (`Passes.ahead`,
        at most `limit`): a run's, where its next steps depend on nothing but its draws — no
        grammar matcher or logit rules, whose state this side updates with each draw, no
        allowed mask, scores or kept state — and stay in the page its last new token is
        written to, leaving that page's last slot to a step sent by the scheduler, so that
        the prefix cache plans the copy of every page a run completes (`prepare`) and only
        pages it stamped for this step are written meanwhile."""
        if self.steps_left <= 1 or self.cancelled or self.parent is not None or not self.token_ids \
                or len(self.outputs) != 1:
            return 0
        o = self.outputs[0]
        if (o.matcher is not None or o.rules is not None or o.allowed is not None or o.entropy or o.dist_k
                or o.logprob_ids or o.keep >= 0 or not o.sample):
            return 0
        last = self.context_slots() + self.tokens - 1  # the slot of the last new token
        return max(0, min(limit, self.steps_left - 1, self.page_size - 2 - last % self.page_size))

    def ends_with(self, token: int) -> bool:
        """Whether `token`, just drawn, ends the run: a stop token, or (a run that sends its
        text) the token that completes a stop string, whose text goes out from here."""
        if token in self.stop_tokens:
            return True
        return self.echo is not None and self.echo.feed(token)

    @property
    def text_cut(self) -> bool:
        """A stop string ended this run's text (`run-text`): steps taken ahead are not needed."""
        return self.echo is not None and self.echo.cut

    def advance(self, token: int) -> None:
        """Make this pass the run's next step: `token` in at the next position and slot."""
        ps = self.page_size
        self.filled += self.tokens
        self.last_position = (self.positions[-1] if self.positions else self.last_position) + 1
        n_pages = math.ceil(self.filled / ps)
        self.kv_pages = self.run_pages[:n_pages]
        self.last_len = self.filled - (n_pages - 1) * ps
        self.out_pages = [self.run_pages[self.filled // ps]]
        self.out_offset = self.filled % ps
        self.token_ids, self.positions, self.embeds, self.mask = [token], [self.last_position], [], None
        if self.prefix is not None:
            self.prefix.append(token)
        out = self.outputs[0]
        if out.rules is not None:
            out.rules.see(token)
        out.index, self.index_base = 0, 0
        if out.seed >= 0:
            out.seed = (out.seed + 1) % (1 << 63)
        self.steps_left -= 1
        self._derive()


class PassResults:
    """One queue's passes with something for `take`, in the order they got it.

    It is also the queue's `results-ready` future: level-triggered (ready while anything
    is listed), duck-typing `HostFuture` for `wait_any`, so one pollable serves every pass.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ready: list[Pass] = []
        self.open = 0  # passes submitted and not yet finished
        self._waiters: list[threading.Event] = []

    def opened(self) -> None:
        with self.lock:
            self.open += 1

    def publish(self, p: Pass, status: Status, tokens: list[int] = (),  # type: ignore[assignment]
                details: list[dict[str, Any]] | None = None, error: HostError | None = None,
                wakes: list[threading.Event] | None = None) -> None:
        """Record progress of `p` (scheduler thread) and wake whoever waits for the queue;
        with `wakes`, append the waiters' events to it instead, for the caller to set later
        (`settle`)."""
        with self.lock:
            if p.status is not Status.RUNNING:
                return  # already final (cancelled before it ran, or failed)
            p.fresh.extend(tokens)
            if details is not None:
                p.details = details
            p.status, p.error = status, error
            if status is not Status.RUNNING:
                self.open -= 1
                if p.echo is not None:  # the rest of its text, before the taker wakes for the end
                    p.echo.close()
            if status is Status.RUNNING and (not p.stream or len(p.fresh) < p.stream_every):
                return  # kept for the end of the run or the next wake: nobody is woken now
            if not p.listed:
                p.listed = True
                self.ready.append(p)
            waiters, self._waiters = self._waiters, []
        if wakes is not None:
            wakes.extend(waiters)
            return
        for event in waiters:
            event.set()

    def take(self) -> list[tuple[int, Status, list[int], list[dict[str, Any]], HostError | None]]:
        with self.lock:
            out = []
            for p in self.ready:
                out.append((p.pass_id, p.status, p.fresh, p.details, p.error))
                p.fresh, p.listed = [], False
            self.ready = []
            return out

    def idle(self) -> bool:
        """Nothing to take and nothing that will produce anything."""
        with self.lock:
            return not self.ready and self.open == 0

    # HostFuture's interface, as `wait_any` uses it
    def done(self) -> bool:
        return bool(self.ready)

    def _add_waiter(self, event: threading.Event) -> bool:
        with self.lock:
            if self.ready:
                return False
            self._waiters.append(event)
            return True

    def _remove_waiter(self, event: threading.Event) -> None:
        with self.lock:
            if event in self._waiters:
                self._waiters.remove(event)


# --- the wire --------------------------------------------------------------------------------


def _i32(values: list[int]) -> bytes:
    return array("i", values).tobytes()


def _f32(values: list[float]) -> bytes:
    return array("f", values).tobytes()


def encode(batch: list[Pass], ahead_steps: int = 0) -> P.Passes:
    """The batch as one `Passes` request (packed columns; x86 and ARM are little-endian);
    runs may go on for up to `ahead_steps` steps in the backend (`Pass.ahead`)."""
    tok, emb, pos, tptr = [], [], [], [0]
    kv, kvptr, lens, out, outptr, offs, masks = [], [0], [], [], [0], [], []
    oidx, flags, temp, topk, topp, minp, seed, distk, keep, lp, lpptr = ([] for _ in range(11))
    allowed: list[bytes | None] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    bias_ptr = [0]
    lpptr.append(0)
    oindptr = [0]
    for p in batch:
        emb += p.embeds + [-1] * len(p.token_ids)
        tok += [-1] * len(p.embeds) + p.token_ids
        pos += [0] * len(p.embeds) + p.positions
        tptr.append(len(tok))
        kv += p.kv_pages
        kvptr.append(len(kv))
        lens.append(p.last_len if p.kv_pages else 0)
        out += p.out_pages
        outptr.append(len(out))
        offs.append(p.out_offset)
        masks.append(p.mask)
        for o in p.outputs:
            oidx.append(o.index)
            flags.append((P.FLAG_SAMPLE if o.sample else 0) | (P.FLAG_ENTROPY if o.entropy else 0))
            temp.append(o.temperature)
            topk.append(o.top_k)
            topp.append(o.top_p)
            minp.append(o.min_p)
            seed.append(o.seed)
            distk.append(o.dist_k)
            keep.append(o.keep)
            lp += o.logprob_ids
            lpptr.append(len(lp))
            allowed.append(o.matcher.allowed_mask() if o.matcher is not None else o.allowed)
            if o.rules is not None:
                ids, values = o.rules.entries()
                bias_ids += ids
                bias_values += values
            bias_ptr.append(len(bias_ids))
        oindptr.append(len(oidx))
    ahead = [p.ahead(ahead_steps) for p in batch] if ahead_steps else []
    # One grant for the batch, the least of its items': an item granted fewer steps than the
    # others would sit out their last ones (its queue stays busy until the batch's final
    # step), so staggered decoders, each at its own page offset, stalled most of a window.
    # 8 streamed clients (Zen 5, 6 alternating rounds, one-off): mean TTFT 165 -> 145 ms,
    # 27 -> 23 ms per output token, 228 -> 285 tok/s; level with no steps ahead at 8 and 32.
    ahead = [min(ahead)] * len(ahead) if ahead and min(ahead) else []
    stops: dict[str, bytes] = {}
    if any(ahead):
        stop_ids = [t for p, a in zip(batch, ahead) for t in (sorted(p.stop_tokens) if a else ())]
        stop_ptr = list(itertools.accumulate((len(p.stop_tokens) if a else 0 for p, a in zip(batch, ahead)),
                                             initial=0))
        stops = {"ahead": _i32(ahead), "stop_ids": _i32(stop_ids), "stop_indptr": _i32(stop_ptr)}
    copy_before = [page for p in batch for pair in p.copy_in for page in pair]
    copy_after = [page for p in batch for _, own, cached in p.saves for page in (own, cached)]
    return P.Passes(
        copy_before=_i32(copy_before), copy_after=_i32(copy_after),
        token_ids=_i32(tok), embed_ids=_i32(emb), positions=_i32(pos), token_indptr=_i32(tptr),
        kv_page_ids=_i32(kv), kv_page_indptr=_i32(kvptr), kv_last_page_lens=_i32(lens),
        out_kv_page_ids=_i32(out), out_kv_page_indptr=_i32(outptr), out_kv_offsets=_i32(offs),
        attention_masks=masks if any(m is not None for m in masks) else [],
        out_indptr=_i32(oindptr), out_index=_i32(oidx), flags=bytes(flags), temperature=_f32(temp),
        top_k=_i32(topk), top_p=_f32(topp), min_p=_f32(minp), seed=array("q", seed).tobytes(),
        dist_k=_i32(distk), keep_embed=_i32(keep), logprob_ids=_i32(lp), logprob_indptr=_i32(lpptr),
        allowed=allowed if any(a is not None for a in allowed) else [],
        **({"bias_ids": _i32(bias_ids), "bias_values": _f32(bias_values), "bias_indptr": _i32(bias_ptr)}
           if bias_ids else {}),
        **stops,
    )


def _unpack(code: str, data: bytes) -> list:
    values = array(code)
    values.frombytes(data)
    return values.tolist()


def settle(batch: list[Pass], reply: P.PassesReply) -> tuple[list[Pass], list[threading.Event]]:
    """Publish each pass's results (scheduler thread); return the runs that go on, advanced
    to their next step, for the scheduler to put back at the head of their queues, and the
    events that wake the instances' threads waiting for these results, for the scheduler to
    set once the next batch has left. Woken first, 32 streaming instances' threads held the
    scheduler off the GIL for a median 22 ms between decode steps of ~230 ms; sent first,
    the gap is 2 ms (serving workload, 32 streamed clients, AMD EPYC, 2 vCPUs). On those 2
    vCPUs the instances' work then runs beside the step and slows it about as much (64.2
    -> 64.6 tok/s, within noise); with a core to spare it is time won."""
    tokens = _unpack("i", reply.tokens)
    entropy = _unpack("f", reply.entropy)
    logprobs = _unpack("f", reply.logprobs)
    dist_ids, dist_probs = _unpack("i", reply.dist_ids), _unpack("f", reply.dist_probs)
    dist_ptr = _unpack("i", reply.dist_indptr)
    again: list[Pass] = []
    wakes: list[threading.Event] = []
    row = lp = 0
    for item, p in enumerate(batch):
        rows = range(row, row + len(p.outputs))
        row += len(p.outputs)
        lp_start = lp
        lp += sum(len(o.logprob_ids) for o in p.outputs)
        results = p.queue.results
        if p.cache is not None:
            p.cache.settled(p, item not in reply.errors)
        if item in reply.errors:
            results.publish(p.owner, Status.FAILED, error=HostError(
                ErrorKind.INFERENCE_FAILED, f"pass {p.pass_id}: {reply.errors[item]}"), wakes=wakes)
            continue
        if p.parent is not None:
            continue  # a chunk: its parent reports when it ends
        drawn, details, at = [], [], lp_start
        for r, o in zip(rows, p.outputs):
            n_lp = len(o.logprob_ids)
            if o.sample:
                drawn.append(tokens[r])
                # A stop token ends the run: not part of the text, and llguidance refuses EOS
                # once the grammar is complete (it only allows it).
                if o.advance and o.matcher is not None and tokens[r] not in p.stop_tokens:
                    try:
                        o.matcher.accept([tokens[r]])
                    except HostError as e:
                        results.publish(p, Status.FAILED, drawn, error=e, wakes=wakes)
                        break
            if o.dist_k or n_lp or o.entropy:
                details.append({"index": o.index + p.index_base, "top_ids": dist_ids[dist_ptr[r]:dist_ptr[r + 1]],
                                "top_probs": dist_probs[dist_ptr[r]:dist_ptr[r + 1]],
                                "logprobs": logprobs[at:at + n_lp],
                                "entropy": entropy[r] if o.entropy else None})
            at += n_lp
        else:
            ends = bool(drawn) and p.ends_with(drawn[0])  # (feeds a text echo every draw)
            going = p.steps_left > 1 and not p.cancelled and not ends
            ended = Status.CANCELLED if p.cancelled and p.steps_left > 1 else Status.DONE
            results.publish(p, Status.RUNNING if going else ended, drawn, details, wakes=wakes)
            if going:
                p.advance(drawn[0])
                again.append(p)
    return again, wakes


def settle_step(going: dict[int, Pass], step: P.PassesStep) -> tuple[list[threading.Event], int]:
    """Publish a step the backend took on its own (`PassesStep`) for the runs of its request
    still going (`going`: item index -> pass, each at the step the backend computed), as
    `settle` does a reply: each drawn token, then the run's next step (`Pass.advance`), so
    this side's passes stay where the backend's are. Runs that end leave `going`; the
    scheduler puts the rest back at the head of their queues after the final step. Returns
    the events that wake the instances waiting for these results, and how many items the
    backend stepped."""
    tokens = _unpack("i", step.tokens)
    wakes: list[threading.Event] = []
    for item, p in list(going.items()):
        if item in step.errors:
            del going[item]
            p.queue.results.publish(p, Status.FAILED, error=HostError(
                ErrorKind.INFERENCE_FAILED, f"pass {p.pass_id}: {step.errors[item]}"), wakes=wakes)
            continue
        token = tokens[item] if item < len(tokens) else -1
        if token < 0:
            continue  # not stepped: it goes on from here in the scheduler's next batch
        ends = p.ends_with(token)  # (feeds a text echo every draw)
        go = p.steps_left > 1 and not p.cancelled and not ends
        ended = Status.CANCELLED if p.cancelled and p.steps_left > 1 else Status.DONE
        p.queue.results.publish(p, Status.RUNNING if go else ended, [token], wakes=wakes)
        if go:
            p.advance(token)
        else:
            del going[item]
    return wakes, sum(t >= 0 for t in tokens)


def fail(batch: list[Pass], error: HostError) -> None:
    """Passes that will not run (whole request refused, backend gone, instance ended)."""
    for p in batch:
        p.dropped = True
        if p.cache is not None:
            p.cache.settled(p, False)
        p.queue.results.publish(p.owner, Status.FAILED, error=error)
