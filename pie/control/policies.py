"""Batching policies (paper Table 5): *when* the scheduler sends a batch, of which kind, and
in what order the waiting queues fill it.

A policy sees a `ReadyView` of the calls that could go now and answers with a kind to send
or how long to wait before asking again; it orders queues by `key` of their `Head`. It
does no I/O and holds no scheduler state, so each is tested on synthetic views
(tests/test_policies.py). `control.scheduler` names one of `POLICIES`.

Queues are ordered first by objective (`scheduling.set-queue-objective`: latency before
throughput before background), then by priority (`set-queue-priority`), then by the
policy's key: arrival order for every policy but `srjf`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from pie import protocol as P
from pie.config import ControlConfig

HEAVY = (P.Kind.FORWARD, P.Kind.PASS)  # kinds that run the model: batched together, gathered
K_POLICY_MAX_WAIT_S = 0.1
# How long prompts may wait for the rest of a wave of launches when nothing decodes: 8
# launched at once submitted their prompts over 23 ms here (instantiation runs one at a
# time), and the first, sent alone after half a decode step, cost the wave ~75 ms.
GATHER_WAIT_S = 0.03


@dataclass(frozen=True)
class ReadyView:
    """What a policy decides on: per kind, how many heads could go and when the oldest was
    enqueued; the backend's state; and, per heavy kind, whether open queues that ran the model
    within the last three forwards, and read what it computed, are about to submit again
    (`stragglers`), and whether only prompts wait (nothing decodes) while launched instances
    have yet to submit theirs (`gathering`)."""

    count: dict[str, int]
    oldest: dict[str, float]
    backend_idle: bool
    last_forward_s: float
    now: float
    stragglers: frozenset[str] = frozenset()
    gathering: bool = False

    def preferred(self) -> str:
        """The oldest-waiting kind, except that the model-running kinds yield to cheaper ones.

        embed_text, sample and the rest cost a fraction of a forward; running them first
        lets their queues reach their next forward, so forwards gather into one batch instead
        of splitting across rounds (measured: 8 concurrent decoders went from +156% to
        near-direct time per token). A forward that has waited longer than the last forward
        batch took goes first anyway, so it cannot starve.
        """
        heavy = {k: t for k, t in self.oldest.items() if k in HEAVY}
        others = {k: t for k, t in self.oldest.items() if k not in HEAVY}
        if not heavy or not others:
            return min(self.oldest, key=self.oldest.__getitem__)
        first = min(heavy, key=heavy.__getitem__)
        if self.now - heavy[first] > self.last_forward_s:
            return first
        return min(others, key=others.__getitem__)

    def waited(self, kind: str) -> float:
        return self.now - self.oldest[kind]


class Objective(IntEnum):
    """`scheduling.objective`: what a queue's calls are for; lower values go first."""

    LATENCY = 0
    THROUGHPUT = 1  # every queue's until it says otherwise
    BACKGROUND = 2


@dataclass(frozen=True, slots=True)
class Head:
    """A waiting queue as a policy orders it (within its objective and priority): when its
    head call was enqueued (its task group's oldest, so a group goes together), and its
    job's estimated remaining work in seconds (the job-size hint if the queue gave one, else
    the head call's new tokens not in the prefix cache; times a token's measured cost)."""

    enqueued: float
    estimate_s: float


Decision = tuple[str | None, int | None]  # (kind to send, or None and ms to wait; None = until woken)


class Policy(Protocol):
    single: bool  # one call per batch
    sizes_jobs: bool  # its key reads Head.estimate_s (the scheduler computes it only then)

    def choose(self, view: ReadyView) -> Decision: ...

    def key(self, head: Head, now: float) -> float: ...


class FirstCome:
    """Arrival order within an objective and priority: every policy of the paper's."""

    sizes_jobs = False

    def key(self, head: Head, now: float) -> float:
        return head.enqueued


class Adaptive(FirstCome):
    """Work-conserving (the default): send as soon as the backend is idle. One exception:
    while queues that ran the model recently are still between calls (about to submit their
    next one), wait for them — at most half a forward's duration — so decoders share one
    batch instead of drifting into groups that each pay a full forward; while only prompts
    wait for a wave of launches, up to GATHER_WAIT_S. (Host-side runs need no waiting: the
    reply that ends a run's step queues its next one.)"""

    single = False

    def choose(self, view: ReadyView) -> Decision:
        if not view.backend_idle:
            return None, None  # the reply (or the idle signal) wakes the loop
        kind = view.preferred()
        patience = 0.5 * view.last_forward_s
        if view.gathering:
            patience = max(patience, GATHER_WAIT_S)
        if kind not in view.stragglers or view.waited(kind) >= patience:
            return kind, None
        return None, max(1, int((patience - view.waited(kind)) * 1e3))


class Eager(FirstCome):
    """No batching (the paper's baseline): every call alone, at once, even while the
    backend is busy."""

    single = True

    def choose(self, view: ReadyView) -> Decision:
        return view.preferred(), None


@dataclass
class CountK(FirstCome):
    """Once `k` calls of one kind wait; a call never waits longer than `max_wait_s`."""

    k: int
    max_wait_s: float = K_POLICY_MAX_WAIT_S
    single = False

    def choose(self, view: ReadyView) -> Decision:
        if not view.backend_idle:
            return None, None
        ready = [kind for kind, n in view.count.items() if n >= self.k]
        if ready:
            return min(ready, key=view.oldest.__getitem__), None
        kind = view.preferred()
        if view.waited(kind) >= self.max_wait_s:
            return kind, None
        return None, max(1, int((self.max_wait_s - view.waited(kind)) * 1e3))


@dataclass
class TimeT(FirstCome):
    """Once the oldest waiting call has waited `t_s`."""

    t_s: float
    single = False

    def choose(self, view: ReadyView) -> Decision:
        if not view.backend_idle:
            return None, None
        kind = view.preferred()
        if view.waited(kind) >= self.t_s:
            return kind, None
        return None, max(1, int((self.t_s - view.waited(kind)) * 1e3))


@dataclass
class Srjf(Adaptive):
    """PrefillOnly's shortest-remaining-job-first with a waiting credit: dispatches as
    `adaptive` does, but a batch takes the queues with the least estimated work first
    (`estimate - credit * wait`, re-evaluated at every dispatch: a prompt whose prefix was
    cached meanwhile counts only its uncached tokens). Without the credit a long job starves
    while short ones keep arriving; with it, each second waited forgives `credit` seconds of
    estimated work (`control.srjf_lambda`)."""

    credit: float = 0.0
    sizes_jobs = True

    def key(self, head: Head, now: float) -> float:
        return head.estimate_s - self.credit * (now - head.enqueued)


POLICIES = ("adaptive", "eager", "k", "t", "srjf")


def policy_for(config: ControlConfig) -> Policy:
    """The policy `control.scheduler` names."""
    if config.scheduler == "eager":
        return Eager()
    if config.scheduler == "k":
        return CountK(config.batch_k)
    if config.scheduler == "t":
        return TimeT(config.batch_t_ms / 1e3)
    if config.scheduler == "srjf":
        return Srjf(config.srjf_lambda)
    return Adaptive()
