"""Transparent huge pages for the backend's weights (weight_arena.py).

A decode step streams its weights once (269 MB for SmolLM2-135M in bf16); in 4 KB pages each
4 KB of that stream is a TLB miss. A tensor's memory advised `MADV_HUGEPAGE` before anything
is written to it is backed by 2 MB pages where the kernel has them on (`madvise` or `always`
in /sys/kernel/mm/transparent_hugepage/enabled); elsewhere the advice is refused and the
memory stays as it was, so this is never an error. The KV pools stay in ordinary pages: in
huge pages a batch-32 step at 512 tokens of context was no faster (in-process, alternating
runs, AMD EPYC Zen 4), since attention reads a page's 6 KB of keys at a time, not a stream.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from functools import cache

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@cache
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Advise the whole 2 MB extents `t`'s memory covers (call it before writing to `t`).
    Whether the advice was taken: False off Linux, with transparent huge pages off, or for a
    tensor that covers no whole extent."""
    madvise = _madvise()
    start = t.data_ptr()
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = (start + t.numel() * t.element_size()) // HUGE_PAGE * HUGE_PAGE
    if madvise is None or t.device.type != "cpu" or last <= first:
        return False
    return madvise(first, last - first, MADV_HUGEPAGE) == 0


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor starting on a 2 MB boundary, advised before any write."""
    numel = 1
    for d in shape:
        numel *= d
    size = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)  # untouched: malloc maps fresh pages
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start:start + size].view(dtype).view(shape)
    advise_huge_pages(out)
    return out
