"""Fork/join: many continuations of one context, decoded together so they batch.

`generate_branches(parent, suffixes, samplers, stop)` is the twin of Rust's
`inferlet::generate_branches` (same arguments, same `Branch` fields). Each branch is a fork
of the parent (its full pages shared, its partial last page copied before the branch
writes) on a queue of its own, decoding as a host-side run: runs on different queues share
every batch, so n branches cost about one decode's steps, and the inferlet is woken once
per branch rather than per token. (Rust decodes the branches in lockstep on the parent's
queue instead, one pass per branch per step; both batch the same way.)
"""

from __future__ import annotations

from dataclasses import dataclass

from inferlet.sampling import Sampler, Stop

__all__ = ["Branch", "generate_branches"]


@dataclass
class Branch:
    """One finished continuation: the `suffix` tokens appended before generating, the
    generated `text`, the parent's length when it was made (`parent_len`), and `context`,
    the fork holding it (continue it, or let it go to free its own pages)."""

    suffix: list[int]
    text: str
    parent_len: int
    context: object


def generate_branches(parent, suffixes: list[list[int]], samplers: list[Sampler], stop: Stop) -> list[Branch]:
    """One continuation of `parent` per entry of `suffixes` (tokens appended to the parent's
    pending ones for that branch; pass empty lists for n plain samples), decoded together.
    Branch i uses `samplers[i]` (the last one if fewer are given); a seeded sampler uses
    seed + step, as `Context.generate`. Flush the parent first so that its prompt is
    prefilled once, not once per branch."""
    if not samplers:
        raise ValueError("generate_branches needs at least one sampler")
    parent.queue.synchronize()  # the forks read the parent's pages from other queues
    forks = []
    for i, suffix in enumerate(suffixes):
        fork = parent.fork(parent.queue.model.create_queue())
        fork.fill_tokens(list(suffix))
        forks.append((fork, fork.start_generate(samplers[min(i, len(samplers) - 1)], stop)))
    return [Branch(list(suffix), generation.result(), len(parent), fork)
            for suffix, (fork, generation) in zip(suffixes, forks)]
