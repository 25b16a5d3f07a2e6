"""Which backend replica a new instance runs on (`backend.replicas` > 1).

An instance stays on one replica for life: its pages, embeds and queues live in that
replica's pools and scheduler. Placement therefore happens once, at launch, when the
control layer knows only the program and its arguments, not the tokens it will fill.

`cache-aware` (the default) follows SGLang's router: it remembers, per replica, the
launches placed there as a set of chained hashes of their arguments' 64-byte blocks (per
program), and places a launch where the longest leading run of its blocks is found: an
`openai_completion` carrying the same system prompt, a `text_completion` extending an
earlier prompt, goes where that prompt's KV pages probably sit in the prefix cache. Below
half a match, or when replicas' live instances differ by more than
`control.placement_imbalance`, load decides instead: the replica with the fewest live
instances. `least-loaded` always decides by load. The remembered blocks are bounded per
replica (least recently matched go first), so memory stays fixed however many launches.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

BLOCK_BYTES = 64  # one remembered block of a launch's arguments
MAX_BLOCKS = 65536  # remembered per replica (~5 MiB at most: 16-byte keys in an OrderedDict)
MIN_MATCH = 0.5  # a launch goes by cache only if at least this share of its blocks matched


class Placeable(Protocol):
    """What placement reads of a replica (pie/control/replica.py)."""

    index: int
    live: int  # instances running on it
    serving: bool  # its backend is up


def blocks(program: str, arguments: list[str]) -> list[bytes]:
    """Chained hashes of the blocks of a launch's arguments, keyed by its program: block i's
    key names the program and every byte before it too, so equal keys mean equal prefixes."""
    data = "\0".join(arguments).encode()
    keys, h = [], hashlib.blake2b(program.encode(), digest_size=16)
    for start in range(0, len(data), BLOCK_BYTES):
        h.update(data[start:start + BLOCK_BYTES])
        keys.append(h.copy().digest())
    return keys


class PrefixMemory:
    """One replica's remembered launch prefixes."""

    def __init__(self, capacity: int = MAX_BLOCKS):
        self.capacity = capacity
        self.keys: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, this replica has seen."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n

    def remember(self, keys: list[bytes]) -> None:
        """Newest last, and a launch's first block newest of its own: what ages out first
        is the tail of old prefixes, never a head whose tail stays (unmatchable)."""
        for key in reversed(keys):
            self.keys[key] = None
            self.keys.move_to_end(key)
        while len(self.keys) > self.capacity:
            self.keys.popitem(last=False)

    def forget(self) -> None:
        """The replica's backend restarted: its prefix cache is empty."""
        self.keys.clear()


class Placement:
    """`control.placement`: pick a serving replica for a launch and remember the choice."""

    def __init__(self, policy: str, imbalance: int, replicas: int):
        self.policy = policy
        self.imbalance = imbalance
        self.memories = [PrefixMemory() for _ in range(replicas)]

    def choose(self, replicas: Sequence[Placeable], program: str, arguments: list[str]) -> Placeable | None:
        """The replica for this launch, or None when no replica serves. Called under the
        controller's placement lock, so `live` counts do not move meanwhile."""
        serving = [r for r in replicas if r.serving]
        if not serving:
            return None
        least = min(serving, key=lambda r: (r.live, r.index))
        if len(serving) == 1 or self.policy == "least-loaded":
            return least
        keys = blocks(program, arguments)
        chosen = least
        if max(r.live for r in serving) - least.live <= self.imbalance and keys:
            best = max(serving, key=lambda r: (self.memories[r.index].matched(keys), -r.live, -r.index))
            if self.memories[best.index].matched(keys) >= MIN_MATCH * len(keys):
                chosen = best
        self.memories[chosen.index].remember(keys)
        return chosen

    def forget(self, replica: int) -> None:
        self.memories[replica].forget()
