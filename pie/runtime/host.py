"""One instance's host state: its wasm resources, its link to the control layer, and its
budgets. The host functions themselves are in `pie/runtime/bindings/`, one module per WIT
interface. Wasm resources (queues, futures, pollables, subscriptions, matchers) live in a
per-instance table keyed by the rep we hand to wasmtime.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from wasmtime import Store
from wasmtime.component import ResourceAny, ResourceHost

from pie.control.controller import InstanceSession
from pie.control.future import Cancellation, HostFuture, wait_any


class Kind(IntEnum):
    """What a guest handle refers to (the resource types of sdk/wit)."""

    QUEUE = 1
    POLLABLE = 2
    FUTURE_UNIT = 3
    FUTURE_STRING = 4
    SUBSCRIPTION = 5
    FUTURE_RESPONSE = 6
    FUTURE_DIST = 7
    FUTURE_TOKEN = 8
    MATCHER = 9


class LimitExceeded(Exception):
    """Raised inside a host call to end an instance that broke a limit its API call cannot
    report as an error (a message too large to deliver); the message is the reason."""


class Terminated(Exception):
    """Raised inside a host call to unwind an instance that is being terminated."""


@dataclass(frozen=True)
class Budgets:
    """What one instance may spend: times in seconds (0 = no budget), and host objects.

    `cpu_s` (quota.instance.cpu_s) is CPU time of the instance's own thread — guest code and
    the host work its calls do there — in total; `wall_s` (quota.instance.wall_s) is time
    since launch; `slice_s` (runtime.cpu_slice_ms) the longest stretch of guest code between
    two host calls. Wasm code is interrupted only at epoch deadlines, so `tick_s` (the
    engine's epoch period) and `check_s` (how often a computing guest is checked) bound how
    far past a budget it can get."""

    cpu_s: float = 0.0
    wall_s: float = 0.0
    slice_s: float = 5.0
    tick_s: float = 0.01
    check_s: float = 0.1
    handles: int = 65536  # runtime.max_handles: host objects held at once


class HostState:
    """One instance's wasm resources, its link to the control layer, and its budgets.

    Budgets are enforced at two points, both on the instance's thread: at every host call
    (`check`, from the `call` wrapper), and, for guest code that makes none, at epoch
    deadlines (`on_deadline`, wasmtime's deadline callback; `deadline_ticks` arms the next
    one). A wait blocked in the host is ended from outside through `cancelled` (the runtime
    terminates an instance whose wall budget runs out)."""

    def __init__(self, session: InstanceSession, send: Callable[[str], threading.Event | None],
                 budgets: Budgets, forward_log: Callable[[str, str], threading.Event | None] | None = None):
        self.session = session
        self.send_message = send
        self.forward_log = forward_log  # (level, line) to the client that asked for the log
        self.budgets = budgets
        self.objects: dict[int, tuple[Kind, Any]] = {}
        self.next_rep = 1
        self.cancelled = Cancellation()
        self.store: Store | None = None
        self.calls: Counter[str] = Counter()  # host function name -> calls (benchmarks)
        self.watched: dict[int, tuple[int, HostFuture]] = {}  # pollable rep -> (key, future)
        self.launched = time.monotonic()  # the wall budget counts from here
        self.cpu_start: float | None = None  # thread_time() when the thread began (start())
        self.resumed = self.launched  # when guest code last got control back (CPU slice)
        self.end_reason: str | None = None  # why a limit ended the instance, once one did
        # "panicked at FILE:LINE:COL: MESSAGE" or "out of memory: ..." (the Rust SDK logs them
        # before it aborts): what the trap that follows is
        self.panic: str | None = None
        self.deadline: Any = None  # the store's DeadlineCallback, kept alive with it

    # --- budgets ------------------------------------------------------------------------------

    def start(self) -> None:
        """Called first thing on the instance's own thread: its CPU time counts from here."""
        self.cpu_start = time.thread_time()
        self.resumed = time.monotonic()

    def cpu_used(self) -> float:
        """CPU seconds of this instance's thread; only meaningful on that thread."""
        return 0.0 if self.cpu_start is None else time.thread_time() - self.cpu_start

    def wall_expired(self, now: float) -> bool:
        return bool(self.budgets.wall_s) and now - self.launched >= self.budgets.wall_s

    def wall_reason(self) -> str:
        return (f"error: wall-clock budget exhausted: {self.budgets.wall_s:g} s since launch "
                f"(quota.instance.wall_s)")

    def over_budget(self) -> str | None:
        """The reason to end the instance now, if a limit says so (on its own thread)."""
        if self.budgets.cpu_s and self.cpu_used() >= self.budgets.cpu_s:
            return (f"error: CPU budget exhausted: {self.budgets.cpu_s:g} s of CPU time "
                    f"(quota.instance.cpu_s)")
        if self.wall_expired(time.monotonic()):
            return self.wall_reason()
        return None

    def check(self) -> None:
        """At every host call: unwind a terminated instance, end one past a limit."""
        if self.cancelled.is_set():
            raise Terminated("instance terminated")
        if (reason := self.over_budget()) is not None:
            self.end_reason = reason
            raise LimitExceeded(reason.removeprefix("error: "))

    def on_deadline(self) -> str | None:
        """wasmtime's epoch-deadline callback, in the middle of guest code: None lets it go
        on (for `deadline_ticks()` more ticks), a string traps it with that reason."""
        reason = self.over_budget()
        if reason is None and self.cancelled.is_set():
            reason = "terminated"
        if reason is None and time.monotonic() - self.resumed >= self.budgets.slice_s:
            reason = (f"trap: CPU limit — ran longer than runtime.cpu_slice_ms = "
                      f"{round(self.budgets.slice_s * 1e3)} ms without a host call")
        if reason is not None:
            self.end_reason = self.end_reason or reason
        return reason

    def deadline_ticks(self) -> int:
        """Epoch ticks until guest code is next checked: the check period, or sooner when the
        CPU slice or CPU budget would run out first (CPU time on this thread cannot advance
        faster than the clock, so a deadline at the remaining CPU budget is never late)."""
        b = self.budgets
        now = time.monotonic()
        left = min(b.check_s, b.slice_s - (now - self.resumed))
        if b.cpu_s:
            left = min(left, b.cpu_s - self.cpu_used())
        return max(1, math.ceil(left / b.tick_s))

    def own(self, kind: Kind, obj: Any) -> ResourceHost:
        """A new guest handle for `obj`. Each one is host memory until the guest drops it, so
        an instance that holds runtime.max_handles is ended rather than let grow."""
        if len(self.objects) >= self.budgets.handles:
            raise LimitExceeded(f"the instance holds {len(self.objects)} handles (futures, pollables, "
                                f"...) it never dropped: runtime.max_handles = {self.budgets.handles}")
        rep, self.next_rep = self.next_rep, self.next_rep + 1
        self.objects[rep] = (kind, obj)
        return ResourceHost.own(rep, kind)

    def get(self, store: Any, handle: Any, kind: Kind) -> Any:
        rep = handle.to_host(store).rep if isinstance(handle, ResourceAny) else handle
        held = self.objects.get(rep)
        if held is None or held[0] != kind:
            raise Terminated(f"unknown {kind.name.lower()} handle {rep}")  # wasmtime prevents this
        return held[1]

    def drop(self, store: Any, rep: int) -> None:
        kind, obj = self.objects.pop(rep, (None, None))
        self.watched.pop(rep, None)
        if kind == Kind.SUBSCRIPTION:  # dropping a subscription unsubscribes (the WIT)
            self.session.unsubscribe(obj)
        elif kind == Kind.MATCHER:  # passes can no longer name it by id
            self.session.forget_matcher(obj[1])
        elif kind == Kind.QUEUE:  # its pending calls still run; its quota comes back
            self.session.drop_queue(obj)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The instance blocks in the host: while no call of its own is queued or running,
        the reclaimer may move its pages (pie/control/reclaimer.py); they come back before
        its next call that names one."""
        self.session.pause(True)
        try:
            yield
        finally:
            self.session.pause(False)

    def wait_for(self, event: threading.Event) -> None:
        """Block until `event` is set, or unwind if the instance is terminated meanwhile."""
        if event.is_set():
            return
        with self.paused():
            while not event.wait(0.05):
                if self.cancelled.is_set():
                    raise Terminated("instance terminated")

    def pace(self, rate: str) -> None:
        """Wait out the instance's (and its user's) rate quota before a message or HTTP call."""
        delay = self.session.wait_s(rate)
        if delay > 0:
            with self.paused():
                if self.cancelled.wait(delay):
                    raise Terminated("instance terminated")

    def watch(self, store: Any, pollable: Any, key: int) -> None:
        rep = pollable.to_host(store).rep
        self.watched[rep] = (key, self.get(store, rep, Kind.POLLABLE))

    def wait(self) -> list[int]:
        """Block until a watched pollable is ready; unwatch the ready ones, return their keys."""
        if not self.watched:
            return []
        reps = list(self.watched)
        futures = [self.watched[r][1] for r in reps]
        ready = [i for i, f in enumerate(futures) if f.done()]
        if not ready:  # it blocks: paused (a ready one costs no pause bookkeeping)
            with self.paused():
                ready = wait_any(futures, self.cancelled)
        if self.cancelled.is_set():
            raise Terminated("instance terminated")
        return sorted(self.watched.pop(reps[i])[0] for i in ready)
