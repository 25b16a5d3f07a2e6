"""Beam search over forked contexts (the twin of Rust's `inferlet::beam`): every beam is a
`Context.fork` of its parent (pages shared copy-on-write), and each step asks every live
beam for its next-token distribution at once (the requests batch together), keeping the
`beams` best extensions by total log-probability."""

from __future__ import annotations

import math

from inferlet.futures import wait_all

__all__ = ["beam_search"]


def beam_search(ctx, beams: int, max_tokens: int, eos: list[int]) -> list[tuple[list[int], float]]:
    """The `beams` most likely continuations of `ctx` (which must have a pending token, e.g.
    after `fill_chat`) found by beam search, best first: (tokens, total natural-log
    probability). A beam ends after `max_tokens` tokens or at a token of `eos` (included in
    its tokens and its log-probability)."""
    beams = max(1, beams)
    live = [(0.0, ctx.fork(), [])]  # (log-probability, context, tokens)
    done: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        if not live:
            break
        embeds = [beam.forward_pending([len(beam.pending) - 1])[0] for _, beam, _ in live]
        dists = wait_all([ctx.queue.next_dist(e, beams) for e in embeds])
        candidates = sorted(((score + math.log(p), i, token) for i, (score, _, _) in enumerate(live)
                             for token, p in zip(*dists[i]) if p > 0), key=lambda c: -c[0])[:beams]
        survivors = []
        for score, i, token in candidates:
            _, parent, tokens = live[i]
            if token in eos:
                done.append((tokens + [token], score))
                continue
            child = parent.fork()
            child.fill_tokens([token])
            survivors.append((score, child, tokens + [token]))
        live = survivors
    done += [(tokens, score) for score, _, tokens in live]
    return sorted(done, key=lambda d: -d[1])[:beams]
