"""A batchable API call (`Command`) and the per-instance queue it waits on (`CommandQueue`):
the one object the host bindings build, the scheduler batches and the batch codec encodes.
Commands of one queue run in order; a later one may share a batch with earlier ones of its
queue only where `conflicts` allows.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pie import protocol as P
from pie.control.errors import HostError
from pie.control.future import HostFuture
from pie.control.passes import PassResults
from pie.control.policies import Objective

MARKER = "marker"  # a command kind of its own: synchronize, deferred release (`Command.on_head`)


@dataclass(eq=False)
class CommandQueue:
    instance_id: str
    priority: int = 0
    # scheduling.set-queue-objective / set-job-size: the queue's class, its task group
    # ((user, name): a group's queues are ordered together), and its job's remaining new
    # tokens as the program estimated them (0: no hint), less what has been sent since.
    objective: Objective = Objective.THROUGHPUT
    group: tuple[str, str] | None = None
    job_left: int = 0
    pending: deque["Command"] = field(default_factory=deque)
    closed: bool = False
    # The guest dropped it: its pending commands still run, it sends no new ones, and it
    # leaves the scheduler once they have (`Scheduler.release_queue`).
    released: bool = False
    # First failure of a call whose result nobody awaits (forward, embed, copy, mask):
    # reported by the next synchronize.
    error: HostError | None = None
    results: PassResults = field(default_factory=PassResults)  # fused passes' results


@dataclass(eq=False)
class Command:
    """One API call. `item` holds protocol fields (physical ids); `tokens` counts toward the
    backend's max_batch_tokens; `reads`/`writes` name the embeds/pages it touches."""

    kind: str  # a protocol Kind value, or MARKER
    queue: CommandQueue
    future: HostFuture
    item: dict[str, Any] = field(default_factory=dict)
    tokens: int = 0
    reads: frozenset = frozenset()
    writes: frozenset = frozenset()
    on_head: Callable[[], Any] | None = None  # markers: run when the command reaches the head
    # Run once the command has run (with None) or failed or will never run (with the reason):
    # the reclaimer's swaps release the pages they emptied here.
    on_done: Callable[[str | None], Any] | None = None
    silent: bool = False  # no caller awaits the future: a failure goes to queue.error
    enqueued: float = field(default_factory=time.monotonic)


def conflicts(later: Command, earlier: list[Command]) -> bool:
    """A later command may join a batch with earlier ones of its queue only if it neither
    reads nor writes what they write (read-after-write, write-after-write)."""
    written = frozenset().union(*(c.writes for c in earlier))
    return bool(written & (later.reads | later.writes))


def reads_result(command: Command) -> bool:
    """Whether the caller reads what this forward computes (a drawn token, a distribution,
    an output embed): then it is likely computing its next call from it, a straggler worth
    waiting for (`Scheduler._view`). A forward that only writes KV (a shared prefix filled
    on a queue of its own) says nothing of a next call: waiting for its queue held the
    semantic-variables chain's first decode step ~0.25 s, half the prefill before it."""
    if command.kind == P.Kind.PASS:
        return bool(command.outputs)  # type: ignore[attr-defined]
    return bool(command.item.get("out_embeds"))
