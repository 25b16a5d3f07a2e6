"""The automatic prefix cache (`control.prefix_cache`): full KV pages of prompts, kept in
pages of their own and copied into later passes that start with the same tokens.

Why: a client-side agent sends its whole conversation with every request, and each request
is a fresh instance that would prefill all of it again. vLLM's automatic prefix caching is a
large part of why it beat Pie's `/v1` on the agent workloads (issue 17).

How, at the pass level, so every inferlet benefits with no SDK or WIT change:
* A pass *from the start* (no context pages, no input embeds, no attention mask, positions
  0..n-1, output pages from offset 0) has a known prefix: its tokens. Page j of it is named
  by a chained hash of every token up to the page's end, scoped to the user (one user never
  reads another's cache; their timing cannot tell them what another user sent).
* So does a pass that *continues* pages whose contents the cache knows (an SDK's second
  fill of a live context, a prompt's later chunk): tokens only, at the positions after the
  context, in slots that continue it. The cache knows what a page holds when the last
  command that wrote it was such a pass and it succeeded (`Written`, recorded when the pass
  settles); sending any command that writes a page (a forward with embeds, a mask, a copy,
  a swap-in) forgets it first, so a stale record is never read. Checking a context reads
  its pages' records (~35 us for 125 pages with the other core busy; see `_know`).
* When such a pass is sent (`prepare`), the longest run of its full pages from its context's
  end found in the cache is copied into its own pages by the backend, before the forward
  (`Passes.copy_before`; a partial last context page is overwritten with the same tokens'
  keys and values), and the pass keeps only the rest of its tokens (`Pass.split`, as a
  prefill chunk would). At least the tokens from its first output on are computed.
* Two passes that start alike in one batch compute their shared pages once: the later
  one is held back for a batch and finds them cached (`prepare`'s deferral, once per pass).
* Each full page such a pass (or a later step of its run) completes is copied, after the
  forward and in the same request (`Passes.copy_after`), into a page the cache owns, and
  indexed when the reply comes. Copies, not shared references: an instance never finds its
  own pages turned read-only, and a cache page is always the cache's alone to drop.
* A scoring pass from the start (no context, writes no KV: `Context::score` after an
  unflushed fill, a one-token completion) is served in place (`_serve_in_place`): it
  writes none of its pages, so cached ones become its context where they lie, and the
  full pages it computes are written straight into new cache pages, the rest into pages
  freed when it settles. A scoring request then holds no pages while it waits.
* Cache pages count in the pool but belong to nobody: when an allocation finds the pool
  short, least-recently-used cache pages go first (`reclaim`; a run's deeper pages are
  older than its first, so a chain is cut from its end). A cache page being copied into a
  pass stays alive until that pass settles.

A page costs a copy of its K/V (~370 KB for the default model, bf16): microseconds against
the ~18 ms its 16 tokens take to prefill on a 2-vCPU CPU.
"""

from __future__ import annotations

import hashlib
import math
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie.control.command import Command
    from pie.control.passes import Pass
    from pie.control.resources import PhysicalPool

Key = tuple[str, bytes]  # (user, chained hash of the tokens up to a page's end)


@dataclass(frozen=True, slots=True, eq=False)
class Written:
    """What an instance's page holds, as the pass that last wrote it left it: the user's
    scope, the page's tokens from slot 0 on, the chained hash up to its end (a full page),
    and the serial number of this record and of the one it follows (the previous page's,
    as the pass saw it; 0 for a first page)."""

    n: int
    prev: int
    scope: str
    tokens: tuple[int, ...]
    hash: bytes | None


SERIAL, PREV, HASH = attrgetter("n"), attrgetter("prev"), attrgetter("hash")


def chain(p: Pass, pages: int) -> list[bytes]:
    """The chained hashes of the pass's first `pages` pages: `p.chain`, extended from the
    tokens of `p.prefix` (which starts at slot `p.prefix_base`, where `p.chain` ends)."""
    ps, known, base = p.page_size, p.chain, p.prefix_base
    for j in range(len(known), pages):
        tokens = array("i", p.prefix[j * ps - base:(j + 1) * ps - base]).tobytes()  # type: ignore[index]
        known.append(hashlib.blake2b((known[-1] if known else b"") + tokens, digest_size=16).digest())
    return known


class PrefixCache:
    """Cache pages by key, least recently used first; guarded by the pool's lock."""

    def __init__(self, pool: PhysicalPool, lock: threading.Condition, page_size: int):
        self.pool, self.lock, self.page_size = pool, lock, page_size
        self.entries: OrderedDict[Key, int] = OrderedDict()  # key -> physical page
        self.saving: set[Key] = set()  # copies in flight: not indexed yet, not planned twice
        # Instances' pages whose contents are known, and the stamp of the last command sent
        # that writes each page: a pass records what it wrote only if it is still that one.
        self.written: dict[int, Written] = {}
        self.writer: dict[int, int] = {}
        self.stamps = self.serial = 0
        self.lookups = self.lookup_tokens = self.hit_tokens = 0
        self.saved_pages = self.evicted_pages = 0

    # --- when a batch is sent (scheduler thread) ------------------------------------------

    def prepare(self, batch: list[Pass]) -> list[Pass]:
        """Copy cached pages into the batch's passes whose prefix is known, and plan the
        copies that keep the full pages they complete. Returns the passes to hold back for
        one batch (the caller takes them out): each would compute a page that an earlier pass
        of this batch, or of one in flight, is computing, and will find it cached after."""
        deferred = []
        writers: dict[int, int] = {}  # page -> the one pass of the batch that writes it, or 0
        for p in batch:
            for page in p.out_pages:
                writers[page] = id(p) if writers.get(page, id(p)) == id(p) else 0
        with self.lock:
            for p in batch:
                p.cache = self  # before the check: a `fail` racing this sees one or the other
                if p.dropped:  # failed (backend gone, instance ended) before it was sent
                    continue
                if not p.cache_checked:
                    p.cache_checked = True
                    if p.scores_from_start():
                        if self._serve_in_place(p):
                            p.cache_checked, p.deferred = False, True
                            deferred.append(p)
                        continue
                    if p.prefix is None:
                        self._know(p, writers)
                    if p.prefix is not None and self._reuse(p):
                        p.cache_checked, p.deferred = False, True
                        deferred.append(p)
                        continue
                if p.prefix is not None and not p.in_place:
                    self._plan_saves(p)
            # What the passes sent will write is no longer what any record says.
            held = {id(p) for p in deferred}
            for p in batch:
                if id(p) in held:
                    continue
                self.stamps += 1
                p.stamp = self.stamps
                p.written_from = p.context_slots() // self.page_size - len(p.copy_in)
                for page in [own for _, own in p.copy_in] + p.out_pages:
                    self.written.pop(page, None)
                    self.writer[page] = p.stamp
        return deferred

    def cached_tokens(self, p: Pass) -> int:
        """How many leading tokens of a pass from the start the cache holds now, for a
        policy's estimate of its work (control.scheduler = srjf). Read without the pools'
        lock (from under the scheduler's, which must not take it): a page evicted meanwhile
        only makes the estimate short. The pass's page hashes are kept for `prepare`."""
        scoring = p.scores_from_start()
        if p.kv_pages or not (scoring or p.tokens_only()):
            return 0
        if p.prefix is None:
            p.prefix = list(p.token_ids)
        ps, j = self.page_size, 0
        limit = (p.before_output() if scoring else p.chunkable()) // ps
        while j < limit and (p.scope, chain(p, j + 1)[j]) in self.entries:
            j += 1
        return j * ps

    def overwritten(self, batch: list[Command]) -> None:
        """Forget what the pages a batch of other commands writes held (a forward, a mask, a
        copy, a swap-in): sent now, they change them."""
        pages = [page for c in batch for tag, page in c.writes if tag == "p"]
        if pages:
            with self.lock:
                self.stamps += 1
                for page in pages:
                    self.written.pop(page, None)
                    self.writer[page] = self.stamps

    def _know(self, p: Pass, writers: dict[int, int]) -> None:
        """Set `p.chain` (the hashes of its context's full pages) and `p.prefix` (its tokens
        from the slot after them: a partial last page's, then its own) where the cache knows them: a
        pass from the start, or one continuing pages whose records (still there, so not
        written since) follow one another, with no other pass of its batch writing them.
        The check runs at C speed over the records (measured with the other core busy: ~35
        us for a 125-page context, against ~90 us walking it in Python): a decode step that
        is not part of a run pays it too."""
        if not p.tokens_only():
            return
        if not p.kv_pages:
            p.prefix = list(p.token_ids)
            return
        records = list(map(self.written.get, p.kv_pages))
        if None in records:
            return
        last = records[-1]
        if (last.scope != p.scope or records[0].prev or len(last.tokens) < p.last_len
                or list(map(PREV, records[1:])) != list(map(SERIAL, records[:-1]))
                or any(writers[page] != id(p) for page in writers.keys() & p.kv_pages)):
            return
        full = len(records) - (p.last_len < self.page_size)
        hashes = list(map(HASH, records[:full]))
        if None in hashes:
            return
        partial = list(last.tokens[:p.last_len]) if full < len(records) else []
        p.chain, p.prefix, p.prefix_base = hashes, partial + p.token_ids, full * self.page_size

    def _reuse(self, p: Pass) -> bool:
        """Copy in the longest run of cached full pages from the context's end; True (and
        nothing done) where the pass should wait for a page being saved instead."""
        ps = self.page_size
        context = p.context_slots()
        first = context // ps
        hits = self._take_hits(p, first, (context + p.chunkable()) // ps)
        if hits is None:
            return True
        if hits:
            own = p.slot_pages()[first:first + len(hits)]
            p.split((first + len(hits)) * ps - context)
            p.copy_in = list(zip(hits, own))
        return False

    def _take_hits(self, p: Pass, first: int, end: int) -> list[int] | None:
        """The longest run of the pass's full pages from `first` (below `end`) that the
        cache holds: made most recent, held until the pass settles, counted as hits; None
        (nothing done) where it should wait for a page being saved instead."""
        hits: list[int] = []
        for j in range(first, end):
            key = (p.scope, chain(p, j + 1)[j])
            page = self.entries.get(key)
            if page is None:
                if key in self.saving and not p.deferred:  # held back once, never twice
                    return None
                break
            hits.append(page)
        self.lookups += 1
        self.lookup_tokens += p.tokens
        if hits:
            for j in reversed(range(first, first + len(hits))):  # the first page ends most recent: cut from the end
                self.entries.move_to_end((p.scope, p.chain[j]))
            self.pool.retain(hits)  # alive until the pass settles, whatever evicts them meanwhile
            cached = (first + len(hits)) * self.page_size - p.context_slots()
            p.owner.cached_tokens += cached
            self.hit_tokens += cached
        return hits

    def _serve_in_place(self, p: Pass) -> bool:
        """A scoring pass from the start: read the longest run of its first full pages
        that the cache holds where they lie (it writes none of them, so nothing is copied),
        and write the full pages it computes straight into new cache pages, the rest into
        pages freed when it settles; True (nothing done) where it should wait a batch for a
        page another pass is computing.

        Why: with its prompt's pages its own (a fill, then scores), every waiting scoring
        request held ~50 pages of a 260-page pool before it ran, so under load the pool went
        to requests that were waiting, the cache was evicted, and the scheduler saw only the
        few that had pages; served here, a request holds nothing while it waits. Its pages
        come from the pool only when it is sent (evicting least-recently-used cache pages
        as any allocation does); where even that leaves too few (an input longer than the
        pool), it runs as it came, writing no KV (the backend's chunked path)."""
        ps = self.page_size
        p.prefix = list(p.token_ids)
        full = p.before_output() // ps  # pages before its first output
        hashes = chain(p, full)
        hits = self._take_hits(p, 0, full)
        if hits is None:
            return True
        p.in_place, p.borrowed = True, hits
        keep = {j for j in range(len(hits), full)
                if (p.scope, hashes[j]) not in self.entries and (p.scope, hashes[j]) not in self.saving}
        need = math.ceil(p.tokens / ps) - len(hits) if keep else 0  # nothing to keep: it writes no KV
        if need and self.pool.available < need:
            self.reclaim(need - self.pool.available)
        pages = self.pool.alloc(need) if need and self.pool.available >= need else []
        for j, page in enumerate(pages, start=len(hits)):
            self.written.pop(page, None)
            if j in keep:
                self.saving.add((p.scope, hashes[j]))
                p.fills.append(((p.scope, hashes[j]), page))
            else:
                p.temp.append(page)
        p.read_in_place(hits, pages)
        return False

    def _plan_saves(self, p: Pass) -> None:
        ps = self.page_size
        context = p.context_slots()
        first, end = context // ps, (context + p.tokens) // ps  # pages this pass completes
        if end <= first:
            return
        pages = p.slot_pages()
        hashes = chain(p, end)
        for j in range(first, end):
            key = (p.scope, hashes[j])
            if key in self.entries or key in self.saving:
                continue
            if self.pool.available == 0 and self.reclaim(1) == 0:
                return
            (page,) = self.pool.alloc(1)
            self.written.pop(page, None)  # the copy overwrites what an instance left there
            self.saving.add(key)
            p.saves.append((key, pages[j], page))

    # --- when the batch's reply comes, or it fails (any thread) ---------------------------

    def settled(self, p: Pass, ok: bool) -> None:
        """Index the pass's saved pages (`ok`) or free them; drop its hold on copied-in pages."""
        with self.lock:
            p.dropped = not ok
            if ok and p.prefix is not None and not p.in_place:
                self._record(p)
            self.pool.release([src for src, _ in p.copy_in] + p.borrowed + p.temp)
            for key, page in reversed([(key, page) for key, _, page in p.saves] + p.fills):
                self.saving.discard(key)
                if ok and key not in self.entries:
                    self.entries[key] = page
                    self.saved_pages += 1
                else:
                    self.pool.release([page])
            p.copy_in, p.saves, p.borrowed, p.temp, p.fills = [], [], [], [], []
            if not ok:
                self.lock.notify_all()

    def _record(self, p: Pass) -> None:
        """What the pass wrote (the pages copied in, then its tokens' slots), for a later
        pass that continues them; not where a later command has written since."""
        ps = self.page_size
        end = p.context_slots() + p.tokens
        hashes = chain(p, end // ps)
        pages = p.slot_pages()
        for j in range(p.written_from, math.ceil(end / ps)):
            page = pages[j]
            before = self.written.get(pages[j - 1]) if j else None
            if self.writer.get(page) != p.stamp or (j and before is None):
                return
            self.serial += 1
            self.written[page] = Written(self.serial, before.n if before else 0, p.scope,
                                         tuple(p.prefix[j * ps - p.prefix_base:min(end, (j + 1) * ps) - p.prefix_base]),
                                         hashes[j] if j < len(hashes) else None)

    # --- when the pool runs short, and when the backend restarts --------------------------

    def reclaim(self, count: int) -> int:
        """Free up to `count` cache pages, least recently used first; how many were freed.
        A page being copied into a pass is dropped from the index but freed when it settles."""
        with self.lock:
            freed = 0
            while freed < count and self.entries:
                _, page = self.entries.popitem(last=False)
                self.evicted_pages += 1
                freed += self.pool.refs[page] == 1
                self.pool.release([page])
            if freed:
                self.lock.notify_all()
            return freed

    def clear(self) -> None:
        """Forget every page (their contents are gone with a dead backend)."""
        with self.lock:
            self.pool.release(list(self.entries.values()))
            self.entries.clear()
            self.written.clear()
            self.lock.notify_all()

    def evictable(self) -> int:
        """Cache pages nothing else holds: free for the asking (`reclaim`)."""
        with self.lock:
            return sum(self.pool.refs[page] == 1 for page in self.entries.values())

    def stats(self) -> dict[str, float]:
        with self.lock:
            return {"cached_pages": len(self.entries), "lookups": self.lookups,
                    "lookup_tokens": self.lookup_tokens, "hit_tokens": self.hit_tokens,
                    "hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
                    "saved_pages": self.saved_pages, "evicted_pages": self.evicted_pages}
