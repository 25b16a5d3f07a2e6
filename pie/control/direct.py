"""Drive the backend's handlers straight from a Python loop, without inferlets.

Several sequences advance in lockstep: per step one sample, one embed_text and one forward
for all of them. `pie generate`, the backend tests and benchmarks (the "backend driven
directly" baseline, and the backend's own step time) use it. Pages and embed slots are
split statically between the sequences: this is a driver, not the control layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from pie import protocol as P
from pie.control.backend_link import BackendError, BackendLink


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
    token_embed: int  # the slot the next input token is embedded into
    out_embed: int  # the slot forward writes the last token's hidden state to
    length: int = 0  # tokens whose K/V are in the pages
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
        # Embed slots: two per sequence, the rest a scratch area that prefill chunks reuse.
        self.scratch = min(hs.max_batch_tokens, hs.num_embeds - 2 * n)
        if pages_each * n > hs.num_kv_pages or self.scratch < max(len(p) for p in prompts):
            raise BackendError(
                f"{n} sequences of up to {longest} tokens do not fit the backend's pools "
                f"({hs.num_kv_pages} pages of {ps}, {hs.num_embeds} embeds, "
                f"{hs.max_batch_tokens} tokens per batch)")
        self.seqs = [
            _Sequence(p, list(range(i * pages_each, (i + 1) * pages_each)),
                      hs.num_embeds - 2 * i - 1, hs.num_embeds - 2 * i - 2)
            for i, p in enumerate(prompts)
        ]
        self.steps = 0

    def _call(self, message: P.Message) -> P.Message:
        reply = self.link.call(message)
        errors = getattr(reply, "errors", None)
        if errors:
            raise BackendError(f"{message.kind} failed: {errors}")
        return reply

    def prefill(self) -> None:
        """Run every prompt through the model, in chunks of whole prompts that fit a batch."""
        group: list[_Sequence] = []
        for seq in self.seqs + [None]:  # type: ignore[list-item]
            if seq is None or sum(len(s.prompt) for s in group) + len(seq.prompt) > self.scratch:
                if group:
                    self._prefill_group(group)
                group = []
            if seq is not None:
                group.append(seq)

    def _prefill_group(self, group: list[_Sequence]) -> None:
        tokens = [t for s in group for t in s.prompt]
        self._call(P.EmbedText(tokens, [i for s in group for i in range(len(s.prompt))],
                               list(range(len(tokens)))))
        start, embeds = 0, []
        for s in group:
            embeds.append(list(range(start, start + len(s.prompt))))
            start += len(s.prompt)
        self._forward(group, embeds)

    def step(self, sampling: SamplingParams = SamplingParams(),
             stop_token_ids: tuple[int, ...] = (), limit: int | None = None) -> dict[int, int]:
        """Sample the next token of every live sequence and run it through the model;
        returns {sequence index: token}. A sequence stops at a stop token or `limit` tokens."""
        live = [i for i, s in enumerate(self.seqs) if not s.done]
        if not live:
            return {}
        seed = -1 if sampling.seed < 0 else sampling.seed + self.steps
        reply = self._call(P.Sample(
            embed_ids=[self.seqs[i].out_embed for i in live],
            temperatures=[sampling.temperature] * len(live), top_ks=[sampling.top_k] * len(live),
            top_ps=[sampling.top_p] * len(live), seeds=[seed] * len(live)))
        self.steps += 1
        tokens = dict(zip(live, reply.token_ids))  # type: ignore[attr-defined]
        feed = []
        for i, token in tokens.items():
            seq = self.seqs[i]
            seq.output.append(token)
            seq.done = token in stop_token_ids or (limit is not None and len(seq.output) >= limit)
            if not seq.done:
                feed.append(seq)
        if feed:
            self._call(P.EmbedText([s.output[-1] for s in feed], [s.length for s in feed],
                                   [s.token_embed for s in feed]))
            self._forward(feed, [[s.token_embed] for s in feed])
        return tokens

    def _forward(self, seqs: list[_Sequence], inputs: list[list[int]]) -> None:
        """Append each sequence's input embeds to its pages; output embed = last token."""
        ps = self.hs.page_size
        msg = P.Forward([], [0], [], [], [0], [], [0], [], [], [], [0], [])
        for seq, embeds in zip(seqs, inputs):
            msg.kv_page_ids += seq.pages[: math.ceil(seq.length / ps)]
            msg.kv_page_indptr.append(len(msg.kv_page_ids))
            msg.kv_last_page_lens.append((seq.length - 1) % ps + 1 if seq.length else 0)
            msg.embed_ids += embeds
            msg.embed_indptr.append(len(msg.embed_ids))
            msg.out_kv_page_ids += seq.pages[seq.length // ps : math.ceil((seq.length + len(embeds)) / ps)]
            msg.out_kv_page_indptr.append(len(msg.out_kv_page_ids))
            msg.out_kv_offsets.append(seq.length % ps)
            msg.out_embed_ids.append(seq.out_embed)
            msg.out_token_indices.append(len(embeds) - 1)
            msg.out_embed_indptr.append(len(msg.out_embed_ids))
            msg.attention_masks.append(None)
            seq.length += len(embeds)
        self._call(msg)


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
        batch.prefill()
        while tokens := batch.step(sampling, stop_token_ids, limit=max_new_tokens):
            if on_step:
                on_step(tokens)
        return [s.output for s in batch.seqs]
