"""Drive the backend's handlers straight from a Python loop, without inferlets.

Several sequences advance in lockstep: one embed_text, one forward and one sample per
step for all of them. `pie generate`, the backend tests and the "backend driven directly"
baseline of the overhead benchmark use it. Pages and embed slots are split statically
between the sequences: this is a driver, not the control layer.
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
    pages: list[int]
    embed_base: int  # first of this sequence's input embed slots
    out_embed: int  # the slot forward writes the last token's hidden state to
    length: int = 0  # tokens whose K/V are in the pages
    output: list[int] = field(default_factory=list)
    done: bool = False


class DirectDriver:
    def __init__(self, link: BackendLink, handshake: P.HandshakeReply):
        self.link, self.hs = link, handshake

    def _call(self, message: P.Message) -> P.Message:
        reply = self.link.call(message)
        errors = getattr(reply, "errors", None)
        if errors:
            raise BackendError(f"{message.kind} failed: {errors}")
        return reply

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: tuple[int, ...] = (),
        on_step: Callable[[dict[int, int]], None] | None = None,
    ) -> list[list[int]]:
        """Greedy (or sampled) continuations of `prompts`, at most `max_new_tokens` each."""
        ps = self.hs.page_size
        n = len(prompts)
        longest = max(len(p) for p in prompts) + max_new_tokens
        pages_each = math.ceil(longest / ps)
        embeds_each = max(len(p) for p in prompts) + 2
        if pages_each * n > self.hs.num_kv_pages or embeds_each * n > self.hs.num_embeds:
            raise BackendError(
                f"{n} sequences of up to {longest} tokens do not fit the backend's pools "
                f"({self.hs.num_kv_pages} pages of {ps}, {self.hs.num_embeds} embeds)"
            )
        seqs = [
            _Sequence(list(range(i * pages_each, (i + 1) * pages_each)), i * embeds_each,
                      (i + 1) * embeds_each - 1)
            for i in range(n)
        ]
        # Prefill: every prompt token is embedded into its sequence's slots.
        inputs = [list(range(s.embed_base, s.embed_base + len(p))) for s, p in zip(seqs, prompts)]
        self._call(P.EmbedText(
            token_ids=[t for p in prompts for t in p],
            positions=[i for p in prompts for i in range(len(p))],
            embed_ids=[e for ids in inputs for e in ids],
        ))
        for step in range(max_new_tokens):
            live = [i for i, s in enumerate(seqs) if not s.done]
            if not live:
                break
            self._forward([seqs[i] for i in live], [inputs[i] for i in live])
            sample = self._call(P.Sample(
                embed_ids=[seqs[i].out_embed for i in live],
                temperatures=[sampling.temperature] * len(live),
                top_ks=[sampling.top_k] * len(live),
                top_ps=[sampling.top_p] * len(live),
                seeds=[-1 if sampling.seed < 0 else sampling.seed + step] * len(live),
            ))
            tokens = sample.token_ids  # type: ignore[attr-defined]
            for i, token in zip(live, tokens):
                seqs[i].output.append(token)
                if token in stop_token_ids or len(seqs[i].output) >= max_new_tokens:
                    seqs[i].done = True
            if on_step:
                on_step(dict(zip(live, tokens)))
            feed = [i for i in live if not seqs[i].done]
            if feed:
                self._call(P.EmbedText(
                    token_ids=[seqs[i].output[-1] for i in feed],
                    positions=[seqs[i].length for i in feed],
                    embed_ids=[seqs[i].embed_base for i in feed],
                ))
            for i in feed:
                inputs[i] = [seqs[i].embed_base]
        return [s.output for s in seqs]

    def _forward(self, seqs: list[_Sequence], inputs: list[list[int]]) -> None:
        """Append each sequence's input embeds to its pages; output embed = last token."""
        ps = self.hs.page_size
        msg = P.Forward([], [0], [], [], [0], [], [0], [], [], [], [0], [])
        for seq, embeds in zip(seqs, inputs):
            used = math.ceil(seq.length / ps)
            msg.kv_page_ids += seq.pages[:used]
            msg.kv_page_indptr.append(len(msg.kv_page_ids))
            msg.kv_last_page_lens.append((seq.length - 1) % ps + 1 if seq.length else 0)
            msg.embed_ids += embeds
            msg.embed_indptr.append(len(msg.embed_ids))
            first, last = seq.length // ps, math.ceil((seq.length + len(embeds)) / ps)
            msg.out_kv_page_ids += seq.pages[first:last]
            msg.out_kv_page_indptr.append(len(msg.out_kv_page_ids))
            msg.out_kv_offsets.append(seq.length % ps)
            msg.out_embed_ids.append(seq.out_embed)
            msg.out_token_indices.append(len(embeds) - 1)
            msg.out_embed_indptr.append(len(msg.out_embed_ids))
            msg.attention_masks.append(None)
            seq.length += len(embeds)
        self._call(msg)
