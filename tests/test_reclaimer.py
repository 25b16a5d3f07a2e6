"""The reclaimer's choices (pie/control/reclaimer.py) on the real pools with a recording
scheduler: which paused instance's pages move, where to, and what comes back. The end-to-end
path (real backend, inferlets, SDK recompute) is tests/test_reclaim.py."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest

from pie import protocol as P
from pie.config import QuotaConfig
from pie.control.command import Command, CommandQueue
from pie.control.errors import ErrorKind, HostError
from pie.control.quotas import QuotaBook
from pie.control.reclaimer import Reclaimer
from pie.control.resources import DISCARDED, InstanceResources, ResourceManager
from pie.control.scheduler_stats import Costs

PS = 16


@dataclass
class RecordingScheduler:
    """What the reclaimer asks of the scheduler; swaps are recorded, run by `finish`."""

    busy: set[str] = field(default_factory=set)
    costs: Costs = field(default_factory=Costs)
    last_forward_s: float = 0.05
    sent: list[Command] = field(default_factory=list)

    def idle(self, instance_id: str) -> bool:
        return instance_id not in self.busy

    def create_queue(self, instance_id: str) -> CommandQueue:
        return CommandQueue(instance_id)

    def submit(self, command: Command):
        self.sent.append(command)
        return command.future

    def finish(self, error: str | None = None) -> None:
        for command in self.sent:
            command.on_done(error)
            command.future.set_result(None)
        self.sent.clear()


def world(policy: str, pages: int = 8, host: int = 8, wait_s: float = 0.0):
    manager = ResourceManager(pages, 4, wait_s=wait_s, num_host_pages=host)
    scheduler = RecordingScheduler()
    reclaimer = Reclaimer(manager, scheduler, policy, PS)  # type: ignore[arg-type]
    book = QuotaBook(QuotaConfig())
    return manager, scheduler, reclaimer, book


def instance(book: QuotaBook, name: str, order: int) -> InstanceResources:
    return InstanceResources(book.open("u"), name, "u", order)


def press(manager: ResourceManager, requester: InstanceResources, shortfall: int) -> None:
    """What a short allocation does (under the pools' lock): ask the reclaimer."""
    with manager.lock:
        manager.reclaim(requester, shortfall)  # type: ignore[misc]


def paused(manager: ResourceManager, inst: InstanceResources, ago_s: float) -> None:
    manager.pause(inst, True)
    inst.paused_since = time.monotonic() - ago_s


def test_swap_takes_the_longest_paused_idle_instance_and_restore_brings_it_back():
    manager, scheduler, reclaimer, book = world("swap")
    old, young, busy, me = (instance(book, n, i) for i, n in enumerate(("old", "young", "busy", "me")))
    ids = {inst.instance_id: manager.alloc_pages(inst, 2) for inst in (old, young, busy)}
    for inst, ago in ((old, 5.0), (young, 1.0), (busy, 9.0)):
        paused(manager, inst, ago)
    scheduler.busy.add("busy")  # a call of its own waits or runs: its pages stay
    press(manager, me, 2)
    (swap,) = scheduler.sent
    assert swap.kind == P.Kind.SWAP_KVPAGE and swap.queue.instance_id == "old"
    assert swap.item["to_host"] == [True, True] and reclaimer.incoming == 2
    press(manager, me, 2)
    assert len(scheduler.sent) == 1  # the swap in flight already covers it
    assert manager.pages.available == 2  # the device pages come back when the swap has run
    scheduler.finish()
    assert manager.pages.available == 4 and manager.host.available == 6
    with pytest.raises(HostError, match="in host memory"):
        manager.device_pages(old, ids["old"])
    manager.pause(old, False)
    restoring = threading.Thread(target=reclaimer.restore, args=(old,))
    restoring.start()
    for _ in range(200):
        if scheduler.sent:
            break
        time.sleep(0.01)
    (back,) = scheduler.sent
    assert back.item["to_host"] == [False, False] and back.item["host"] == swap.item["host"]
    scheduler.finish()
    restoring.join(5)
    assert manager.device_pages(old, ids["old"]) and old.away == 0
    assert manager.host.available == 8 and manager.pages.available == 2
    assert reclaimer.stats()["swapped_out"] == reclaimer.stats()["swapped_in"] == 2


def test_shared_and_pinned_pages_never_move():
    manager, scheduler, _, book = world("swap")
    a, b, me = instance(book, "a", 0), instance(book, "b", 1), instance(book, "me", 2)
    shared = manager.alloc_pages(a, 2)
    manager.export(a, shared[:1], "x", persistent=False)  # the export holds page 1 too
    pinned = manager.alloc_pages(b, 1)
    b.classes[pinned[0]] = "pinned"
    paused(manager, a, 3.0)
    paused(manager, b, 3.0)
    press(manager, me, 3)
    (swap,) = scheduler.sent
    assert swap.queue.instance_id == "a" and len(swap.item["device"]) == 1  # only its unshared page


def test_discard_drops_only_discardable_pages_and_the_next_use_says_so():
    manager, scheduler, _, book = world("discard")
    a, me = instance(book, "a", 0), instance(book, "me", 1)
    pages = manager.alloc_pages(a, 3)
    for page in pages[:2]:
        a.classes[page] = "discardable"
    paused(manager, a, 2.0)
    press(manager, me, 2)
    assert not scheduler.sent and manager.pages.available == 7
    assert a.pages.mapping[pages[0]] == DISCARDED and a.away == 2
    assert book.usage("u")["u"]["kv_pages"] == 1  # the user's charge drops the dropped pages
    with pytest.raises(HostError) as e:
        manager.device_pages(a, pages)
    assert e.value.kind == ErrorKind.DISCARDED and f"kv page {pages[0]} was discarded" in e.value.message
    assert manager.device_pages(a, pages[2:])  # the swappable one is untouched
    manager.release(manager.take_pages(a, pages[:2]), [])  # freeing a dropped page is fine
    assert a.away == 0
    manager.release_instance(a)
    assert manager.pages.available == 8


def paused_beside_a_full_pool():
    """min-waste; instance `a` holds 4 pages, `me` 56 of 64; 1 ms a page or a token."""
    manager, scheduler, _, book = world("min-waste", pages=64, host=64)
    a, me = instance(book, "a", 0), instance(book, "me", 1)
    manager.alloc_pages(a, 4)
    manager.alloc_pages(me, 56)
    scheduler.costs = Costs(token_s=1e-3, page_s=1e-3)
    return manager, scheduler, a, me


def test_min_waste_preserves_a_fresh_pause_and_moves_one_that_lasts():
    """APIServe's estimate: keeping C pages for the call's expected rest (its time so far)
    against holding them while they cross the link out and back (or stalling every page
    in use for a recompute, or for a swap beyond what one forward step hides)."""
    manager, scheduler, a, me = paused_beside_a_full_pool()
    # swap: 2 * 4 pages * (4 pages * 1 ms) = 0.032 page-seconds; preserve: 4 pages * T.
    paused(manager, a, 0.005)  # 0.02 page-seconds: keep
    press(manager, me, 4)
    assert not scheduler.sent
    paused(manager, a, 0.05)  # 0.2: swap
    press(manager, me, 4)
    assert len(scheduler.sent) == 1


def test_min_waste_charges_a_swap_beyond_one_step_with_a_stall():
    manager, scheduler, a, me = paused_beside_a_full_pool()
    scheduler.last_forward_s = 0.001  # one page a step hides: 3 beyond, 3 ms x 60 in use
    paused(manager, a, 0.05)  # 0.2 page-seconds against 0.032 + 0.18
    press(manager, me, 4)
    assert not scheduler.sent
    paused(manager, a, 0.1)  # 0.4: swap
    press(manager, me, 4)
    assert len(scheduler.sent) == 1


def test_min_waste_discards_when_host_memory_is_full_and_recompute_is_cheap():
    manager, scheduler, _, book = world("min-waste", pages=64, host=2)
    a, me = instance(book, "a", 0), instance(book, "me", 1)
    for page in manager.alloc_pages(a, 4):
        a.classes[page] = "discardable"
    manager.alloc_pages(me, 56)
    scheduler.costs = Costs(token_s=1e-4, page_s=1e-3)
    # no room to swap 4 pages; discard: 64 tokens * 0.1 ms * 60 in use = 0.38 page-seconds
    paused(manager, a, 0.05)  # preserve: 0.2
    press(manager, me, 4)
    assert a.away == 0
    paused(manager, a, 1.0)  # preserve: 4.0
    press(manager, me, 4)
    assert a.away == 4 and not scheduler.sent


def test_a_failed_swap_out_loses_the_pages_and_frees_both_pools():
    manager, scheduler, _, book = world("swap")
    a, me = instance(book, "a", 0), instance(book, "me", 1)
    pages = manager.alloc_pages(a, 2)
    paused(manager, a, 1.0)
    press(manager, me, 2)
    scheduler.finish(error="backend gone")
    assert manager.pages.available == 8 and manager.host.available == 8
    with pytest.raises(HostError) as e:
        manager.device_pages(a, pages)
    assert e.value.kind == ErrorKind.DISCARDED
    manager.release_instance(a)
    assert manager.pages.available == 8 and manager.host.available == 8


def test_an_allocation_waits_for_the_swap_it_started():
    """A requester short of pages starts a swap and waits (control.alloc_wait_ms) for it."""
    manager, scheduler, _, book = world("swap", wait_s=5.0)
    a, me = instance(book, "a", 0), instance(book, "me", 1)
    manager.alloc_pages(a, 6)
    paused(manager, a, 1.0)
    got: list[list[int]] = []
    requester = threading.Thread(target=lambda: got.append(manager.alloc_pages(me, 4)))
    requester.start()
    for _ in range(200):
        if scheduler.sent:
            break
        time.sleep(0.01)
    assert scheduler.sent and not got
    scheduler.finish()
    requester.join(5)
    assert len(got[0]) == 4 and manager.host.available == 2
