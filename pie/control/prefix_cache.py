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
* When such a pass is sent (`prepare`), the longest run of its leading full pages found in
  the cache is copied into its first output pages by the backend, before the forward
  (`Passes.copy_before`), and the pass keeps only the rest of its tokens (`Pass.split`, as a
  prefill chunk would). At least the tokens from its first output on are computed.
* Two passes that start alike in one batch compute their shared pages once: the later
  one is held back for a batch and finds them cached (`prepare`'s deferral, once per pass).
* Each full page such a pass (or a later step of its run) completes is copied, after the
  forward and in the same request (`Passes.copy_after`), into a page the cache owns, and
  indexed when the reply comes. Copies, not shared references: an instance never finds its
  own pages turned read-only, and a cache page is always the cache's alone to drop.
* Cache pages count in the pool but belong to nobody: when an allocation finds the pool
  short, least-recently-used cache pages go first (`reclaim`; a run's deeper pages are
  older than its first, so a chain is cut from its end). A cache page being copied into a
  pass stays alive until that pass settles.

A page costs a copy of its K/V (~370 KB for the default model, bf16): microseconds against
the ~18 ms its 16 tokens take to prefill on a 2-vCPU CPU.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pie.control.passes import Pass
    from pie.control.resources import PhysicalPool

Key = tuple[str, bytes]  # (user, chained hash of the tokens up to a page's end)


def chain(prefix: list[int], page_size: int, known: list[bytes], pages: int) -> list[bytes]:
    """`known` (the hashes of the first pages of `prefix`) extended to `pages` pages."""
    for j in range(len(known), pages):
        tokens = array("i", prefix[j * page_size:(j + 1) * page_size]).tobytes()
        known.append(hashlib.blake2b((known[-1] if known else b"") + tokens, digest_size=16).digest())
    return known


class PrefixCache:
    """Cache pages by key, least recently used first; guarded by the pool's lock."""

    def __init__(self, pool: PhysicalPool, lock: threading.Condition, page_size: int):
        self.pool, self.lock, self.page_size = pool, lock, page_size
        self.entries: OrderedDict[Key, int] = OrderedDict()  # key -> physical page
        self.saving: set[Key] = set()  # copies in flight: not indexed yet, not planned twice
        self.lookups = self.lookup_tokens = self.hit_tokens = 0
        self.saved_pages = self.evicted_pages = 0

    # --- when a batch is sent (scheduler thread) ------------------------------------------

    def prepare(self, batch: list[Pass]) -> list[Pass]:
        """Copy cached pages into the batch's passes from the start, and plan the copies
        that keep the full pages it completes. Returns the passes to hold back for one batch
        (the caller takes them out): each would compute a page that an earlier pass of this
        batch, or of one in flight, is computing, and will find it cached after."""
        deferred = []
        with self.lock:
            for p in batch:
                p.cache = self  # before the check: a `fail` racing this sees one or the other
                if p.dropped:  # failed (backend gone, instance ended) before it was sent
                    continue
                if not p.cache_checked:
                    p.cache_checked = True
                    if p.from_start() and self._reuse(p):
                        p.cache_checked, p.deferred = False, True
                        deferred.append(p)
                        continue
                if p.prefix is not None:
                    self._plan_saves(p)
        return deferred

    def _reuse(self, p: Pass) -> bool:
        """Copy in the longest run of cached leading pages; True (and nothing done) where
        the pass should wait for a page being saved instead."""
        ps = self.page_size
        p.prefix = list(p.token_ids)
        hits: list[int] = []
        for j in range(p.chunkable() // ps):
            key = (p.scope, chain(p.prefix, ps, p.chain, j + 1)[j])
            page = self.entries.get(key)
            if page is None:
                if key in self.saving and not p.deferred:  # held back once, never twice
                    return True
                break
            hits.append(page)
        self.lookups += 1
        self.lookup_tokens += p.tokens
        if not hits:
            return False
        for j in reversed(range(len(hits))):  # the first page ends most recent: cut from the end
            self.entries.move_to_end((p.scope, p.chain[j]))
        self.pool.retain(hits)  # alive until the pass settles, whatever evicts them meanwhile
        chunk = p.split(len(hits) * ps)
        p.copy_in = list(zip(hits, chunk.out_pages[:len(hits)]))
        self.hit_tokens += len(hits) * ps
        return False

    def _plan_saves(self, p: Pass) -> None:
        ps = self.page_size
        context = p.context_slots()
        first, end = context // ps, (context + p.tokens) // ps  # pages this pass completes
        if end <= first:
            return
        pages = p.slot_pages()
        hashes = chain(p.prefix, ps, p.chain, end)
        for j in range(first, end):
            key = (p.scope, hashes[j])
            if key in self.entries or key in self.saving:
                continue
            if self.pool.available == 0 and self.reclaim(1) == 0:
                return
            (page,) = self.pool.alloc(1)
            self.saving.add(key)
            p.saves.append((key, pages[j], page))

    # --- when the batch's reply comes, or it fails (any thread) ---------------------------

    def settled(self, p: Pass, ok: bool) -> None:
        """Index the pass's saved pages (`ok`) or free them; drop its hold on copied-in pages."""
        with self.lock:
            p.dropped = not ok
            self.pool.release([src for src, _ in p.copy_in])
            for key, _, page in reversed(p.saves):
                self.saving.discard(key)
                if ok and key not in self.entries:
                    self.entries[key] = page
                    self.saved_pages += 1
                else:
                    self.pool.release([page])
            p.copy_in, p.saves = [], []
            if not ok:
                self.lock.notify_all()

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
