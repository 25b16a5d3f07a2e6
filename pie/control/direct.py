"""Drive the backend's handlers straight from a Python loop, without inferlets.

Several sequences advance in lockstep: one fused `pass` request per step embeds every live
sequence's last token, runs the model and draws the next tokens — the best this backend
does per step, so "the backend driven directly" (`pie generate`, benchmarks/overhead.py,
benchmarks/backend.py) is the bar Pie's control layer is held to. Pages are split
statically between the sequences: this is a driver, not the control layer.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

from pie import protocol as P
from pie.control.backend_link import BackendError, BackendLink
from pie.control.passes import Output, Pass, encode


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = -1


@dataclass
class _Sequence:
    prompt: list[int]
    pages: list[int]
    length: int = 0  # tokens whose K/V are in the pages
    drawn: int | None = None  # the token drawn last, not yet returned by `step`
    output: list[int] = field(default_factory=list)
    done: bool = False


class DirectBatch:
    """Sequences whose prompts are prefilled once, then decoded one step at a time."""

    def __init__(self, link: BackendLink, hs: P.HandshakeReply, prompts: list[list[int]],
                 max_new_tokens: int):
        self.link, self.hs = link, hs
        n, ps = len(prompts), hs.page_size
        longest = max(len(p) for p in prompts) + max_new_tokens
        pages_each = math.ceil(longest / ps)
        if pages_each * n > hs.num_kv_pages or hs.max_batch_tokens < max(len(p) for p in prompts):
            raise BackendError(
                f"{n} sequences of up to {longest} tokens do not fit the backend's pools "
                f"({hs.num_kv_pages} pages of {ps}, {hs.max_batch_tokens} tokens per batch)")
        self.seqs = [_Sequence(p, list(range(i * pages_each, (i + 1) * pages_each)))
                     for i, p in enumerate(prompts)]
        self.draws = 0  # passes that drew tokens: a seeded sampler uses seed + draws
        self.sampling = SamplingParams()

    def prefill(self, sampling: SamplingParams = SamplingParams()) -> None:
        """Run every prompt through the model (in groups that fit a batch) and draw each
        sequence's first token."""
        self.sampling = sampling
        group: list[_Sequence] = []
        for seq in self.seqs + [None]:  # type: ignore[list-item]
            if seq is None or sum(len(s.prompt) for s in group) + len(seq.prompt) > self.hs.max_batch_tokens:
                if group:
                    self._run(group, [s.prompt for s in group])
                group = []
            if seq is not None:
                group.append(seq)
        self.draws += 1

    def step(self, sampling: SamplingParams | None = None,
             stop_token_ids: tuple[int, ...] = (), limit: int | None = None) -> dict[int, int]:
        """Return the token each live sequence drew last, and feed it back to draw the next
        (one pass for all); {sequence index: token}. A sequence stops at a stop token or
        `limit` tokens."""
        if sampling is not None:
            self.sampling = sampling
        tokens = {i: s.drawn for i, s in enumerate(self.seqs) if not s.done and s.drawn is not None}
        feed = []
        for i, token in tokens.items():
            seq = self.seqs[i]
            seq.output.append(token)
            seq.done = token in stop_token_ids or (limit is not None and len(seq.output) >= limit)
            if not seq.done:
                feed.append(seq)
        if feed:
            self._run(feed, [[s.drawn] for s in feed])
            self.draws += 1
        return tokens  # type: ignore[return-value]

    def _run(self, seqs: list[_Sequence], inputs: list[list[int]]) -> None:
        """One pass: append each sequence's input tokens to its pages, draw its next token."""
        ps, sp = self.hs.page_size, self.sampling
        seed = -1 if sp.seed < 0 else sp.seed + self.draws
        passes = []
        for seq, tokens in zip(seqs, inputs):
            end = seq.length + len(tokens)
            passes.append(Pass(
                None, 0, ps, tokens, list(range(seq.length, end)), [],  # type: ignore[arg-type]
                seq.pages[: math.ceil(seq.length / ps)], (seq.length - 1) % ps + 1 if seq.length else 0,
                seq.pages[seq.length // ps : math.ceil(end / ps)], seq.length % ps, None,
                [Output(len(tokens) - 1, sample=True, temperature=sp.temperature, top_k=sp.top_k,
                        top_p=sp.top_p, seed=seed)]))
            seq.length = end
        reply = self.link.call(encode(passes))
        if getattr(reply, "errors", None):
            raise BackendError(f"pass failed: {reply.errors}")  # type: ignore[attr-defined]
        drawn = array("i")
        drawn.frombytes(reply.tokens)  # type: ignore[attr-defined]
        for seq, token in zip(seqs, drawn):
            seq.drawn = token


class DirectDriver:
    def __init__(self, link: BackendLink, handshake: P.HandshakeReply):
        self.link, self.hs = link, handshake

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: tuple[int, ...] = (),
        on_step: Callable[[dict[int, int]], None] | None = None,
    ) -> list[list[int]]:
        """Greedy (or sampled) continuations of `prompts`, at most `max_new_tokens` each."""
        batch = DirectBatch(self.link, self.hs, prompts, max_new_tokens)
        batch.prefill(sampling)
        while tokens := batch.step(sampling, stop_token_ids, limit=max_new_tokens):
            if on_step:
                on_step(tokens)
        return [s.output for s in batch.seqs]
