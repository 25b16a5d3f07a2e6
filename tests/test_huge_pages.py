"""Huge pages for the backend's big tensors (pie/backend/huge_pages.py) and the weight arena
that packs the bf16 kernel's weights into them (pie/backend/weight_arena.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pie.backend.huge_pages import HUGE_PAGE, empty_huge
from pie.backend.weight_arena import WeightArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode ('always', 'madvise', 'never'), or None."""
    if not THP.is_file():
        return None
    text = THP.read_text()
    return text[text.index("[") + 1:text.index("]")]


def test_empty_huge_starts_on_a_huge_page():
    t = empty_huge((3, HUGE_PAGE), torch.bfloat16)
    assert t.shape == (3, HUGE_PAGE) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    t.fill_(1.5)  # writable, every byte of it
    assert float(t.float().sum()) == 1.5 * t.numel()
    assert empty_huge((0,), torch.float32).numel() == 0


@pytest.mark.skipif(thp_mode() != "madvise" and thp_mode() != "always",
                    reason="the kernel has transparent huge pages off: the advice cannot be checked")
def test_advised_memory_is_backed_by_huge_pages():
    def anon_huge_kb() -> int:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
        return 0

    # Freed heap memory first: malloc would hand it out again with its 4 KB pages mapped.
    for _ in range(3):
        torch.empty(24 << 20, dtype=torch.uint8).fill_(1)
    before = anon_huge_kb()
    t = empty_huge((16 * HUGE_PAGE,), torch.uint8)
    t.fill_(7)
    # The kernel may fall back to 4 KB pages when it has no free 2 MB frames; half is plenty.
    assert anon_huge_kb() - before >= 8 * HUGE_PAGE // 1024
    del t


def test_arena_places_copies_one_after_another():
    arena = WeightArena(block_bytes=1 << 20)
    a = torch.randn(48, 64).to(torch.bfloat16)
    b = torch.randn(7, 5)  # fp32, 140 bytes: the next one starts on a 64-byte boundary
    c = torch.randn(3, 4).to(torch.bfloat16)
    pa, pb, pc = arena.place(a), arena.place(b), arena.place(c)
    for src, dst in ((a, pa), (b, pb), (c, pc)):
        assert torch.equal(src, dst) and dst.dtype == src.dtype and dst.data_ptr() != src.data_ptr()
    assert pa.data_ptr() % HUGE_PAGE == 0  # a block starts on a huge page
    assert pb.data_ptr() == pa.data_ptr() + a.numel() * 2
    assert pc.data_ptr() == pb.data_ptr() + 192  # 140 bytes rounded up to 64
    a.zero_()
    assert not torch.equal(a, pa)  # a copy, not a view


def test_arena_opens_a_block_when_one_is_full_and_takes_weights_larger_than_a_block():
    arena = WeightArena(block_bytes=4096)
    small = arena.place(torch.ones(1000, dtype=torch.float32))  # 4000 bytes of 4096
    big = arena.place(torch.arange(5000, dtype=torch.float32))  # 20 KB: a block of its own
    after = arena.place(torch.full((10,), 3.0))
    assert len(arena.blocks) == 3
    assert torch.equal(big, torch.arange(5000, dtype=torch.float32))
    assert float(small.sum()) == 1000 and float(after.sum()) == 30


def test_arena_reserves_slots_its_caller_fills():
    arena = WeightArena(block_bytes=1 << 20)
    a = arena.reserve((4, 8), torch.bfloat16)
    b = arena.reserve((3,), torch.float32)
    assert a.shape == (4, 8) and a.dtype == torch.bfloat16 and a.is_contiguous()
    assert b.data_ptr() == a.data_ptr() + 64  # 64 bytes of a, then b on the next 64-byte boundary
    a.fill_(2.0)
    b.fill_(-1.0)
    assert float(a.float().sum()) == 64.0 and float(b.sum()) == -3.0
