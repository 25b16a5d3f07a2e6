"""What a short KV pool takes from instances paused on I/O (`control.kv_pressure`).

Why: an inferlet waiting on a tool call, a message or a timer holds device pages that
running instances need. APIServe (../shared/seeds-notes.md) chooses per paused request
between preserving its KV, discarding it (the program computes it again on return) and
swapping it to host memory, by the memory each choice wastes; that gave 1.6x the request
rate of discarding. Here the choice is made when an allocation cannot be met
(`ResourceManager._wait_for` calls `reclaim`), among instances that are

- paused: blocked in a host wait (`HostState.wait`, a send's backpressure, a rate quota;
  `ResourceManager.pause`), and
- idle: no call of theirs waits in a queue or runs (`Scheduler.idle`), so no command the
  backend will run names their pages.

Only pages the instance alone holds move (an exported, imported, forked or cached page is
shared and stays), and never one it marked pinned; only one it marked discardable
(`set-kv-class`, which SDK contexts that can re-prefill do) is discarded. Policies:

- `preserve` (alias `wait`): nothing moves; the allocation waits, then fails.
- `swap`: the most wasteful paused instance's pages go to the host tier
  (`backend.num_host_kv_pages`), then the next, until the shortfall is covered.
- `discard`: likewise, but its discardable pages are dropped.
- `min-waste`: per paused instance, the cheapest of APIServe's three wastes, in page-seconds
  of device memory: preserving holds its C pages for the rest of its call, estimated as
  the time it has been paused so far (`C * T_paused`); swapping holds them while they
  cross the link out and back (`2 * C * C * page_s`), plus, for what the swaps in flight
  carry beyond one forward step's worth (`swap_budget`: the part that no longer hides
  under compute), a stall of every page in use; discarding stalls every page in use for
  its recompute (`tokens * token_s * in_use`). `page_s` and `token_s` are measured from
  the backend's replies (`Scheduler.costs`; a swap's reply comes when the link has carried
  it). So a pause shorter than its pages' round trip is preserved, a longer one moved.
  Charging every swap with a stall of all pages in use, as an earlier version did, held
  on to pages the link could have moved: over a link limited to 0.15 GB/s it sustained
  0.194 requests/s against plain swap's 0.300 (benchmarks/api_serve.py, Xeon).
- `terminate-newest`: the paper's FCFS policy, in the runtime (`Runtime._evict_newer`).

A swapped instance gets its pages back transparently when it next names one
(`restore`, on its own thread, before the call goes on): new device pages, in launch order
behind older instances' waiting allocations, then one swap-in on its swap queue.
"""

from __future__ import annotations

import math
import time

from pie import protocol as P
from pie.control.command import Command
from pie.control.errors import ErrorKind, HostError
from pie.control.future import HostFuture, wait_any
from pie.control.resources import DISCARDED, InstanceResources, ResourceManager
from pie.control.scheduler import Scheduler

POLICIES = ("min-waste", "swap", "discard", "preserve", "wait", "terminate-newest")


class Reclaimer:
    def __init__(self, resources: ResourceManager, scheduler: Scheduler, policy: str, page_size: int):
        self.rm, self.scheduler, self.policy, self.page_size = resources, scheduler, policy, page_size
        self.incoming = 0  # device pages that swaps in flight will free
        self.moved = {"swapped_out": 0, "swapped_in": 0, "discarded": 0}  # pages (/stats)
        if policy in ("min-waste", "swap", "discard"):
            resources.reclaim = self.reclaim

    # --- on the requester's thread, under the pools' lock -------------------------------

    def reclaim(self, requester: InstanceResources, shortfall: int) -> None:
        rm = self.rm
        shortfall -= self.incoming
        if shortfall <= 0:
            return
        now = time.monotonic()
        candidates = []
        for inst in rm.paused.values():
            if inst is requester or inst.paused_since is None:
                continue
            movable = self._movable(inst)
            if movable and self.scheduler.idle(inst.instance_id):
                candidates.append(((now - inst.paused_since) * len(movable), inst, movable))
        candidates.sort(key=lambda c: -c[0])  # the most wasteful to preserve first
        in_use = rm.pages.size - rm.pages.available
        for waste, inst, movable in candidates:
            if shortfall <= 0:
                break
            discardable = [(v, p) for v, p in movable if inst.classes.get(v) == "discardable"]
            action = self._choose(waste, movable, discardable, in_use)
            if action == "swap":
                self._swap_out(inst, movable)
                shortfall -= len(movable)
            elif action == "discard":
                self._discard(inst, discardable)
                shortfall -= len(discardable)

    def _movable(self, inst: InstanceResources) -> list[tuple[int, int]]:
        """(virtual, device page) of the pages only `inst` holds that it has not pinned."""
        pool = self.rm.pages
        return [(v, p) for v, p in inst.pages.mapping.items()
                if pool.holds(p) and pool.refs[p] == 1 and inst.classes.get(v) != "pinned"]

    def _choose(self, waste: float, movable: list, discardable: list, in_use: int) -> str | None:
        can_swap = 0 < len(movable) <= self.rm.host.available
        if self.policy == "swap":
            return "swap" if can_swap else None
        if self.policy == "discard":
            return "discard" if discardable else None
        costs = self.scheduler.costs
        options = {"preserve": waste}
        if can_swap:
            # Its pages stay taken while they cross the link, out and back; what the
            # swaps in flight carry beyond one forward step's worth no longer hides under
            # compute and stalls every page in use.
            pages = len(movable)
            beyond = max(0, self.incoming + pages - self.swap_budget())
            options["swap"] = 2 * pages * pages * costs.page_s + beyond * costs.page_s * in_use
        if discardable:
            options["discard"] = len(discardable) * self.page_size * costs.token_s * in_use
        choice = min(options, key=options.__getitem__)
        return None if choice == "preserve" else choice

    def swap_budget(self) -> int:
        """Pages the link carries in one forward step: swaps in flight up to this many hide
        under compute."""
        s = self.scheduler
        return max(1, math.floor(s.last_forward_s / max(s.costs.page_s, 1e-6)))

    def _swap_out(self, inst: InstanceResources, movable: list[tuple[int, int]]) -> None:
        rm = self.rm
        device = [p for _, p in movable]
        host = rm.host.alloc(len(movable))
        moves = [(v, p, h) for (v, p), h in zip(movable, host)]
        rm.move_pages(inst, moves)
        self.incoming += len(moves)
        self.moved["swapped_out"] += len(moves)

        def done(error: str | None) -> None:
            with rm.lock:
                self.incoming -= len(moves)
                if error is not None:  # the host copy is not there: the pages are lost
                    lost = [(v, h, DISCARDED) for v, _, h in moves if inst.pages.mapping.get(v) == h]
                    rm.move_pages(inst, lost)
                    rm.release_pages([h for _, h, _ in lost])
                rm.release_pages(device)
                rm.lock.notify_all()

        self._swap(inst, device, host, True, done)

    def _discard(self, inst: InstanceResources, pages: list[tuple[int, int]]) -> None:
        rm = self.rm
        rm.move_pages(inst, [(v, p, DISCARDED) for v, p in pages])
        self.moved["discarded"] += len(pages)
        rm.release_pages([p for _, p in pages])
        rm.lock.notify_all()

    def _swap(self, inst: InstanceResources, device: list[int], host: list[int], to_host: bool,
              done) -> HostFuture:
        if inst.swap_queue is None:
            inst.swap_queue = self.scheduler.create_queue(inst.instance_id)
        command = Command(P.Kind.SWAP_KVPAGE, inst.swap_queue, HostFuture(),
                          item={"device": list(device), "host": [h - self.rm.host.base for h in host],
                                "to_host": [to_host] * len(device)}, on_done=done,
                          writes=frozenset() if to_host else frozenset(("p", d) for d in device))
        try:
            return self.scheduler.submit(command)
        except HostError as e:  # the queue closed: the instance is ending
            done(e.message)
            command.future.set_error(e)
            return command.future

    # --- on the paused instance's own thread ----------------------------------------------

    def restore(self, inst: InstanceResources) -> None:
        """Bring the instance's swapped pages back to the device before its call goes on:
        allocate device pages (waiting in launch order), swap in, wait for it."""
        rm = self.rm
        with rm.lock:
            away = [(v, h) for v, h in inst.pages.mapping.items() if rm.host.holds(h)]
            if not away:
                return
            device = rm.alloc_uncharged(inst, len(away))
            moves = [(v, h, d) for (v, h), d in zip(away, device)]
            rm.move_pages(inst, moves)
            self.moved["swapped_in"] += len(moves)

            def done(error: str | None) -> None:
                with rm.lock:
                    if error is not None:  # the device pages hold nothing of it
                        lost = [(v, d, DISCARDED) for v, _, d in moves if inst.pages.mapping.get(v) == d]
                        rm.move_pages(inst, lost)
                        rm.release_pages([d for _, d, _ in lost])
                    rm.release_pages([h for _, h, _ in moves])
                    rm.lock.notify_all()

            future = self._swap(inst, device, [h for _, h in away], False, done)
        wait_any([future])
        try:
            future.result()
        except HostError as e:
            raise HostError(ErrorKind.INFERENCE_FAILED, f"swapping {len(moves)} kv pages back from "
                            f"host memory failed: {e.message}") from None

    def stats(self) -> dict[str, int | str]:
        with self.rm.lock:
            return {"policy": self.policy, **self.moved,
                    "host_pages_free": self.rm.host.available, "host_pages_total": self.rm.host.size,
                    "paused_instances": len(self.rm.paused)}
