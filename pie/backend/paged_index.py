"""An AttentionPlan's keys as a page table: the (indptr, indices, last_page_len) triple that
FlashInfer's paged kernels read (pie/backend/flashinfer_attention.py, cuda_graphs.py).

Pure tensor code on the CPU, so it is tested here without a GPU (tests/test_cuda.py).

A plan lists each item's keys as arbitrary slots (slot = page * page_size + offset): its
context, then the slots its new tokens were written to. A page table can only say "these
whole pages, then the first `last_page_len` slots of one more page". So an item is
expressible iff its i-th key sits at offset i % page_size of the page its chunk
i // page_size starts on. The usual append pattern (context pages, the last one partial,
the new tokens continuing it or opening fresh pages) is; new tokens on scratch slots (items
without output pages), or a context whose last page is partial and whose new tokens go to
another page, are not — `from_plan` returns None and the caller takes another path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pie.backend.attention import AttentionPlan


@dataclass
class PagedIndex:
    """FlashInfer's page table of a batch: int32 tensors on the CPU (its plan() copies them
    to the device)."""

    indptr: torch.Tensor  # [items + 1]: item b's pages are indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor  # [pages]: physical page ids
    last_page_len: torch.Tensor  # [items]: keys on each item's last page, in [1, page_size]

    @classmethod
    def from_plan(cls, plan: AttentionPlan, page_size: int) -> PagedIndex | None:
        """The page table of `plan`'s keys, or None where some item's slot list is not
        whole pages plus a final partial page (see the module docstring)."""
        slots = plan.kv_slots.cpu()
        kv_indptr = torch.tensor(plan.kv_indptr, dtype=torch.int64)
        lengths = kv_indptr.diff()
        if bool((lengths <= 0).any()):
            return None  # an item without keys has no page table (the engine never makes one)
        item = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        position = torch.arange(len(slots)) - kv_indptr[item]  # key index within its item
        offset = position % page_size
        if not bool((slots % page_size == offset).all()):
            return None
        pages = slots // page_size
        starts = offset == 0  # the first key of each page-sized chunk of an item
        chunk = torch.cumsum(starts, 0) - 1
        chunk_page = pages[starts]
        if not bool((pages == chunk_page[chunk]).all()):
            return None  # a chunk spans two pages
        pages_per_item = (lengths + page_size - 1) // page_size
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages_per_item.cumsum(0)])
        last = lengths - (pages_per_item - 1) * page_size
        return cls(indptr.int(), chunk_page.int(), last.int())

    def shared_prefixes(self, min_pages: int, min_members: int) -> list[tuple[list[int], int]]:
        """Groups of items whose page lists begin with the same `n` >= min_pages pages, each
        before the item's last page (a decode item's new token is on its last page), as
        (members, n); groups of fewer than `min_members` are left out. Items are grouped by
        their first page, then cut to the pages all members share (the CPU kernel's rule,
        csrc/shared_prefix.h)."""
        indptr, indices = self.indptr.tolist(), self.indices.tolist()
        by_first: dict[int, list[int]] = {}
        for b in range(len(indptr) - 1):
            if indptr[b + 1] - indptr[b] - 1 >= min_pages:
                by_first.setdefault(indices[indptr[b]], []).append(b)
        groups = []
        for members in by_first.values():
            if len(members) < max(min_members, 2):
                continue
            lead = indices[indptr[members[0]] : indptr[members[0] + 1] - 1]
            n = len(lead)
            for b in members[1:]:
                own = indices[indptr[b] : indptr[b + 1] - 1]
                n = next((i for i, (x, y) in enumerate(zip(lead[:n], own)) if x != y), min(n, len(own)))
            if n >= min_pages:
                groups.append((members, n))
        return groups

    def without_prefixes(self, groups: list[tuple[list[int], int]]) -> PagedIndex:
        """The same table with each group member's first `n` pages dropped (what it reads
        besides its group's shared prefix)."""
        skip = [0] * len(self.last_page_len)
        for members, n in groups:
            for b in members:
                skip[b] = n
        indptr, indices = self.indptr.tolist(), self.indices.tolist()
        kept = [indices[indptr[b] + skip[b] : indptr[b + 1]] for b in range(len(skip))]
        new_indptr = [0]
        for pages in kept:
            new_indptr.append(new_indptr[-1] + len(pages))
        return PagedIndex(torch.tensor(new_indptr, dtype=torch.int32),
                          torch.tensor([p for pages in kept for p in pages], dtype=torch.int32),
                          self.last_page_len.clone())

    def padded(self, items: int, pad_page: int) -> PagedIndex:
        """The same table with items appended up to `items`, each one key on `pad_page`
        (CUDA graph padding rows, whose outputs are discarded)."""
        extra = items - len(self.last_page_len)
        if extra < 0:
            raise ValueError(f"cannot pad {len(self.last_page_len)} items down to {items}")
        tail = self.indptr[-1] + torch.arange(1, extra + 1, dtype=torch.int32)
        return PagedIndex(
            torch.cat([self.indptr, tail]),
            torch.cat([self.indices, torch.full((extra,), pad_page, dtype=torch.int32)]),
            torch.cat([self.last_page_len, torch.ones(extra, dtype=torch.int32)]),
        )
