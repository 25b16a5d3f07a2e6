"""Transparent huge pages for the backend's weights (weight_arena.py).

A decode step streams its weights once (269 MB for SmolLM2-135M in bf16); in 4 KB pages each
4 KB of that stream is a TLB miss. Memory advised `MADV_HUGEPAGE` before anything is written
to it is backed by 2 MB pages where the kernel has them on (`madvise` or `always` in
/sys/kernel/mm/transparent_hugepage/enabled); elsewhere the advice is refused and the memory
stays as it was, so this is never an error. The memory is a fresh anonymous mapping, not
torch's allocator: malloc hands out freed heap memory whose 4 KB pages are already mapped,
and advice comes too late for those (a 32 MB tensor got no huge page after two engines had
been freed in the same process). The KV pools stay in ordinary pages: in huge pages a
batch-32 step at 512 tokens of context was no faster (in-process, alternating runs, AMD
EPYC Zen 4), since attention reads a page's 6 KB of keys at a time, not a stream.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (zero-filled) CPU tensor starting on a 2 MB boundary, in memory of
    its own advised MADV_HUGEPAGE before any write (freed with the tensor)."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # untouched
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds `region` while it lives
    start = -raw.data_ptr() % HUGE_PAGE
    if size and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, start, size)
        except OSError:  # transparent huge pages off: ordinary pages
            pass
    return raw[start:start + size].view(dtype).view(shape)
