"""Physical KV pages and embed slots, and each instance's virtual view of them.

The backend owns the memory; the control layer owns the bookkeeping. Every id an inferlet
holds is virtual and resolved through its own table on every call, so a forged, foreign or
freed id is an error, never another inferlet's data. KV pages are reference-counted so
fork, export and import can share them.

Export names live in their user's namespace: a user sees, imports and removes only its own
exports, and cannot take a name from another user. A name beginning with `public:` is
the one explicit grant: it lives in a namespace shared by every user, where the first user
to export it owns it until it is removed; other users may import it (shared pages are
read-only), never remove or replace it.

KV pages count against quotas as references: an instance is charged for the ids it holds
(allocated or imported), a user for the distinct physical pages that its instances and its
exports keep alive, each once. So exporting pages an instance holds costs its user
nothing more, and a persistent export stays charged to its user after the instance ends,
until it is removed: a user cannot pin more of the pool than its quota.

Pages of an instance paused on I/O may leave the device pool (pie/control/reclaimer.py):
to the host tier, whose ids follow the device pool's ([num_pages, num_pages + host pages)),
or discarded (`DISCARDED`). The instance keeps its virtual ids and its charges; `device_pages`
names a page that is not back on the device as an error.
"""

from __future__ import annotations

import bisect
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pie.control.errors import ErrorKind, HostError
from pie.control.prefix_cache import PrefixCache
from pie.control.quotas import Charges, namespace

Evict = Callable[[str, int, str], None]
Reclaim = Callable[["InstanceResources", int], None]
DISCARDED = -1  # where a discarded page's virtual id points: its contents are gone
# How often an allocation waiting on a short pool asks the reclaimer again: paused
# instances' waste grows with their pause (min-waste).
RECLAIM_RETRY_S = 0.02


class PhysicalPool:
    """Free list plus reference counts over ids [base, base + size)."""

    def __init__(self, size: int, what: str, base: int = 0):
        self.size, self.what, self.base = size, what, base
        self.free = list(range(base + size - 1, base - 1, -1))  # pop() hands out low ids first
        self.refs = [0] * size

    def holds(self, i: int) -> bool:
        return self.base <= i < self.base + self.size

    @property
    def available(self) -> int:
        return len(self.free)

    def alloc(self, count: int) -> list[int]:
        if count > len(self.free):
            raise HostError(ErrorKind.OUT_OF_RESOURCES,
                            f"{count} {self.what} requested, {len(self.free)} free of {self.size}")
        ids = [self.free.pop() for _ in range(count)]
        for i in ids:
            self.refs[i - self.base] = 1
        return ids

    def retain(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i - self.base] += 1

    def release(self, ids: list[int]) -> None:
        for i in ids:
            self.refs[i - self.base] -= 1
            if self.refs[i - self.base] == 0:
                self.free.append(i)


@dataclass
class VirtualTable:
    """One instance's ids for one kind of resource: virtual id -> physical id."""

    what: str
    mapping: dict[int, int] = field(default_factory=dict)
    next_id: int = 1
    peak: int = 0  # the most ids held at once (reported in the instance's usage)

    def add(self, physical: list[int]) -> list[int]:
        ids = list(range(self.next_id, self.next_id + len(physical)))
        self.next_id += len(physical)
        self.mapping.update(zip(ids, physical))
        self.peak = max(self.peak, len(self.mapping))
        return ids

    def resolve(self, ids: list[int]) -> list[int]:
        try:
            return [self.mapping[i] for i in ids]
        except KeyError as e:
            raise HostError(ErrorKind.INVALID_HANDLE,
                            f"{self.what} {e.args[0]} is not a live {self.what} of this instance") from None

    def remove(self, ids: list[int]) -> list[int]:
        if len(set(ids)) != len(ids):
            raise HostError(ErrorKind.INVALID_HANDLE, f"a {self.what} id appears twice")
        physical = self.resolve(ids)
        for i in ids:
            del self.mapping[i]
        return physical


@dataclass
class Export:
    pages: list[int]  # physical
    user: str  # the user who made it, its owner
    owner: str | None  # instance id; None = persistent (outlives its creator)
    charges: Charges  # its creator's accounts, refunded when the export is removed


@dataclass
class InstanceResources:
    charges: Charges
    instance_id: str = ""
    user: str = ""
    order: int = 0  # launch order: older instances' allocations are served first
    pages: VirtualTable = field(default_factory=lambda: VirtualTable("kv page"))
    embeds: VirtualTable = field(default_factory=lambda: VirtualTable("embed"))
    # The reclaimer's view (pie/control/reclaimer.py): since when the instance has been
    # blocked on I/O (None: running); pages it marked pinned or discardable (the rest are
    # swappable); how many of its pages are off the device (in host memory or discarded);
    # the queue its swaps run on (created at its first swap).
    paused_since: float | None = None
    classes: dict[int, str] = field(default_factory=dict)
    away: int = 0
    swap_queue: Any = None


class ResourceManager:
    """All pools of one model, guarded by one lock (calls come from many instance threads).
    An allocation over a quota fails at once; one the pool cannot satisfy now waits up to
    `wait_s` for releases (control.alloc_wait_ms), in launch order behind older instances'
    waiting allocations, then fails: it never takes anything from another instance."""

    def __init__(self, num_pages: int, num_embeds: int, wait_s: float = 0.0,
                 evict: Evict | None = None, prefix_cache_page_size: int = 0, num_host_pages: int = 0):
        self.lock = threading.Condition()
        self.pages = PhysicalPool(num_pages, "kv pages")
        self.host = PhysicalPool(num_host_pages, "host kv pages", base=num_pages)  # backend.num_host_kv_pages
        self.paused: dict[str, InstanceResources] = {}  # instance id -> its pools view, while paused
        # control.kv_pressure: called with (requester, shortfall) when the device pool is
        # short, to move paused instances' pages off it (pie/control/reclaimer.py).
        self.reclaim: Reclaim | None = None
        # control.prefix_cache: pages of prompts kept for reuse, the first to go when the
        # pool runs short (pie/control/prefix_cache.py); None = off.
        self.prefix_cache = (PrefixCache(self.pages, self.lock, prefix_cache_page_size)
                             if prefix_cache_page_size else None)
        self.embeds = PhysicalPool(num_embeds, "embeds")
        self.exports: dict[tuple[str, str], Export] = {}  # namespace(user, name) -> export
        # user -> physical page -> references from the user's instances and exports
        self.user_pages: dict[str, Counter[int]] = {}
        self.wait_s = wait_s
        # pool name -> (launch order, arrival) of each allocation waiting, oldest first
        self.waiters: dict[str, list[tuple[int, int]]] = {}
        self.tickets = itertools.count()
        # control.kv_pressure = terminate-newest: called with (requester, shortfall, pool) to
        # end instances newer than the requester; their teardown refills the pool.
        self.evict = evict

    def alloc_pages(self, inst: InstanceResources, count: int) -> list[int]:
        with self.lock:  # re-entrant: _alloc's wait releases it
            physical = self._alloc(inst, self.pages, count, "kv_pages")
            self._user_hold(inst.user, physical)
            return inst.pages.add(physical)

    def alloc_embeds(self, inst: InstanceResources, count: int) -> list[int]:
        with self.lock:
            return inst.embeds.add(self._alloc(inst, self.embeds, count, "embeds"))

    def alloc_uncharged(self, inst: InstanceResources, count: int) -> list[int]:
        """Device pages for ids the instance already holds and is charged for (pages coming
        back from host memory): waits like any allocation."""
        with self.lock:
            self._wait_for(self.pages, count, inst)
            return self.pages.alloc(count)

    def _alloc(self, inst: InstanceResources, pool: PhysicalPool, count: int, what: str) -> list[int]:
        with self.lock:
            inst.charges.charge(what, count)
            try:
                self._wait_for(pool, count, inst)
                return pool.alloc(count)
            except HostError:
                inst.charges.refund(what, count)
                raise

    # A user's KV charge: its distinct physical pages (see the module docstring).
    def _user_new(self, user: str, pages: list[int]) -> int:
        held = self.user_pages.get(user, Counter())
        return len({p for p in pages if p not in held})

    def _user_hold(self, user: str, pages: list[int]) -> None:
        with self.lock:
            self.user_pages.setdefault(user, Counter()).update(pages)

    def _user_drop(self, user: str, pages: list[int]) -> int:
        """Drop references; how many pages the user no longer keeps alive."""
        pages = [p for p in pages if p != DISCARDED]  # a discarded page was dropped then
        if not pages:
            return 0
        held = self.user_pages[user]
        held.subtract(pages)
        gone = [p for p in set(pages) if held[p] <= 0]
        for p in gone:
            del held[p]
        if not held:
            del self.user_pages[user]
        return len(gone)

    def _wait_for(self, pool: PhysicalPool, count: int, inst: InstanceResources) -> None:
        """Return once `count` of `pool` are free and this request is the oldest waiting
        for them. Waiters are served in launch order (`InstanceResources.order`): a request
        waits behind every older instance's, even where the pool could serve it now, so a
        large request of an old instance is not starved by a stream of small new ones."""
        cache = self.prefix_cache if pool is self.pages else None
        reclaim = self.reclaim if pool is self.pages else None
        queue = self.waiters.setdefault(pool.what, [])
        if cache is not None and pool.available < count:
            cache.reclaim(count - pool.available)
        if reclaim is not None and pool.available < count <= pool.size:
            reclaim(inst, count - pool.available)
        if pool.available < count <= pool.size and self.evict is not None:
            self.evict(inst.instance_id, count - pool.available, pool.what)
        if not (pool.available < count or queue) or count > pool.size or self.wait_s <= 0:
            return  # served now (or failing at once in the pool's alloc)
        ticket = (inst.order, next(self.tickets))
        bisect.insort(queue, ticket)
        try:
            deadline = time.monotonic() + self.wait_s
            while (pool.available < count or queue[0] != ticket) \
                    and (remaining := deadline - time.monotonic()) > 0:
                self.lock.wait(min(remaining, RECLAIM_RETRY_S) if reclaim else remaining)
                if cache is not None and queue[0] == ticket and pool.available < count:
                    cache.reclaim(count - pool.available)  # pages saved meanwhile
                if reclaim is not None and queue[0] == ticket and pool.available < count:
                    reclaim(inst, count - pool.available)
            if pool.available < count or queue[0] != ticket:
                behind = sum(t < ticket for t in queue)
                raise HostError(ErrorKind.OUT_OF_RESOURCES,
                                f"{count} {pool.what} requested, {pool.available} free of {pool.size} "
                                f"after waiting {self.wait_s * 1000:.0f} ms for other instances "
                                f"to free some (control.alloc_wait_ms)"
                                + (f"; {behind} older instances' requests were ahead" if behind else ""))
        finally:
            queue.remove(ticket)
            self.lock.notify_all()  # the next in line

    def take_pages(self, inst: InstanceResources, ids: list[int]) -> list[int]:
        """Invalidate virtual page ids now; the caller releases the physical ones later."""
        with self.lock:
            physical = inst.pages.remove(ids)
            inst.charges.refund("kv_pages", len(ids), self._user_drop(inst.user, physical))
            for i in ids:
                inst.classes.pop(i, None)
            inst.away -= sum(not self.pages.holds(p) for p in physical)
            return physical

    def take_embeds(self, inst: InstanceResources, ids: list[int]) -> list[int]:
        with self.lock:
            physical = inst.embeds.remove(ids)
            inst.charges.refund("embeds", len(ids))
            return physical

    def release(self, pages: list[int], embeds: list[int]) -> None:
        with self.lock:
            self.release_pages(pages)
            self.embeds.release(embeds)
            self.lock.notify_all()

    def release_pages(self, pages: list[int]) -> None:
        """Device or host pages, each to its pool (a discarded page holds nothing)."""
        with self.lock:
            self.pages.release([p for p in pages if self.pages.holds(p)])
            self.host.release([p for p in pages if self.host.holds(p)])

    def move_pages(self, inst: InstanceResources, moves: list[tuple[int, int, int]]) -> None:
        """(Under the lock; the reclaimer's.) Point each (virtual, old, new) page of `inst` at
        its new place: a device page, a host page or DISCARDED. Only pages the instance alone
        holds move, so the user's count follows one for one; a discarded page holds nothing
        and is refunded; `inst.away` counts the pages off the device."""
        held = self.user_pages.setdefault(inst.user, Counter())
        dropped = 0
        for virtual, old, new in moves:
            inst.pages.mapping[virtual] = new
            inst.away += self.pages.holds(old) - self.pages.holds(new)
            held.pop(old, None)
            if new == DISCARDED:
                dropped += old != DISCARDED
            else:
                held[new] = 1
        if dropped:
            inst.charges.refund("kv_pages", 0, dropped)
        if not held:
            del self.user_pages[inst.user]

    def pause(self, inst: InstanceResources, paused: bool) -> None:
        """The instance blocks on I/O (True) or runs again (False); while paused and idle
        the reclaimer may move its pages."""
        with self.lock:
            if paused:
                inst.paused_since = time.monotonic()
                self.paused[inst.instance_id] = inst
            else:
                inst.paused_since = None
                self.paused.pop(inst.instance_id, None)

    def device_pages(self, inst: InstanceResources, ids: list[int]) -> list[int]:
        """Physical ids of the instance's pages, which must be on the device (the session
        brings swapped pages back first); a discarded page is a `discarded` error."""
        physical = inst.pages.resolve(ids)
        if inst.away:
            for virtual, page in zip(ids, physical):
                if page == DISCARDED:
                    raise HostError(ErrorKind.DISCARDED,
                                    f"kv page {virtual} was discarded while the instance waited on "
                                    f"I/O (control.kv_pressure; the page was marked discardable): "
                                    f"deallocate it and compute its tokens again")
                if not self.pages.holds(page):
                    raise HostError(ErrorKind.OUT_OF_RESOURCES,
                                    f"kv page {virtual} is in host memory and the device pool has "
                                    f"no room to bring it back yet; try again")
        return physical

    def writable_pages(self, inst: InstanceResources, ids: list[int]) -> list[int]:
        """Physical ids of pages the instance may write: shared pages are read-only."""
        with self.lock:
            physical = self.device_pages(inst, ids)
            for virtual, page in zip(ids, physical):
                if self.pages.refs[page] > 1:
                    raise HostError(ErrorKind.INVALID_ARGUMENT,
                                    f"kv page {virtual} is shared (exported, imported or forked) "
                                    f"and read-only; copy it into a page of your own to write")
            return physical

    def export(self, inst: InstanceResources, ids: list[int], name: str, persistent: bool) -> None:
        key = namespace(inst.user, name)
        with self.lock:
            if key in self.exports:
                theirs = self.exports[key].user != inst.user
                raise HostError(ErrorKind.ALREADY_EXISTS,
                                f"an export named {name!r} exists"
                                + (" (a public name another user owns)" if theirs else ""))
            physical = self.device_pages(inst, ids)
            inst.charges.charge("exports")
            self._user_hold(inst.user, physical)  # held by the instance: nothing new to charge
            self.pages.retain(physical)
            self.exports[key] = Export(physical, inst.user, None if persistent else inst.instance_id,
                                       inst.charges)

    def has_export(self, user: str, name: str) -> bool:
        with self.lock:
            return namespace(user, name) in self.exports

    def import_(self, inst: InstanceResources, name: str) -> list[int]:
        with self.lock:
            export = self.exports.get(namespace(inst.user, name))
            if export is None:
                raise HostError(ErrorKind.NOT_FOUND, f"no export named {name!r}")
            inst.charges.charge("kv_pages", len(export.pages), self._user_new(inst.user, export.pages))
            self._user_hold(inst.user, export.pages)
            self.pages.retain(export.pages)
            return inst.pages.add(list(export.pages))

    def unexport(self, inst: InstanceResources, name: str) -> None:
        """Only the owner removes an export, and a non-persistent one only its own instance
        (it goes when that instance ends)."""
        key = namespace(inst.user, name)
        with self.lock:
            export = self.exports.get(key)
            if export is None:
                raise HostError(ErrorKind.NOT_FOUND, f"no export named {name!r}")
            if export.user != inst.user:
                raise HostError(ErrorKind.PERMISSION_DENIED,
                                f"the public export {name!r} belongs to another user; only its owner "
                                f"may remove it")
            if export.owner is not None and export.owner != inst.instance_id:
                raise HostError(ErrorKind.PERMISSION_DENIED,
                                f"the export {name!r} belongs to another instance that is still "
                                f"running; it is removed when that instance ends")
            del self.exports[key]
            self._remove(export)
            self.lock.notify_all()

    def drop_exports(self) -> int:
        """Remove every export and cached prefix (their pages' contents are gone with a dead
        backend)."""
        with self.lock:
            if self.prefix_cache is not None:
                self.prefix_cache.clear()
            for export in self.exports.values():
                self._remove(export)
            count = len(self.exports)
            self.exports.clear()
            self.lock.notify_all()
            return count

    def release_instance(self, inst: InstanceResources) -> None:
        """Teardown: every page and embed the instance held, and its non-persistent exports."""
        with self.lock:
            held = list(inst.pages.mapping.values())
            inst.charges.refund("kv_pages", len(held), self._user_drop(inst.user, held))
            self.release_pages(held)
            self.paused.pop(inst.instance_id, None)
            self.embeds.release(list(inst.embeds.mapping.values()))
            inst.pages.mapping.clear()
            inst.embeds.mapping.clear()
            for key in [k for k, e in self.exports.items() if e.owner == inst.instance_id]:
                self._remove(self.exports.pop(key))
            inst.charges.close()
            self.lock.notify_all()

    def exports_of(self, user: str | None) -> int:
        """How many exports `user` owns (None: all)."""
        with self.lock:
            return sum(1 for e in self.exports.values() if user is None or e.user == user)

    def _remove(self, export: Export) -> None:
        self.pages.release(export.pages)
        export.charges.refund("exports")
        export.charges.refund("kv_pages", 0, self._user_drop(export.user, export.pages))
