"""The bf16 kernel's weights copied into blocks of 2 MB pages, in the order a step reads them.

A decode step of a few tokens streams every weight once (269 MB for SmolLM2-135M at batch
1), and csrc/bf16_gemv.cpp's 4-row panels make each weight one sequential stream; in 4 KB
pages that stream misses the TLB every 4 KB. The blocks here come from `empty_huge`
(huge_pages.py). Measured on an AMD EPYC Zen 4 (2 vCPUs; a scratch C++ loop over the 120
layer linears in panels at 1 token, 2 threads): 8.1 ms in 4 KB pages against 6.9 ms in 2 MB
pages. Weights are placed one after another, so a step's consecutive matrices are
neighbours too.
"""

from __future__ import annotations

import math

import torch

from pie.backend.huge_pages import empty_huge

BLOCK_BYTES = 64 << 20  # a block's size unless one weight needs more; the tail left unused is < 1 weight


class WeightArena:
    def __init__(self, block_bytes: int = BLOCK_BYTES):
        self.block_bytes = block_bytes
        self.blocks: list[torch.Tensor] = []
        self.free = 0  # bytes left in the last block

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` inside the arena (same shape and dtype, contiguous)."""
        return self.reserve(tuple(t.shape), t.dtype).copy_(t)

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free contiguous tensor of the arena, on a 64-byte boundary (its bytes
        are zero or a previous occupant's: the caller writes all of it)."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        size = -(-nbytes // 64) * 64
        if size > self.free:
            self.blocks.append(empty_huge((max(size, self.block_bytes),), torch.uint8))
            self.free = len(self.blocks[-1])
        block = self.blocks[-1]
        offset = len(block) - self.free
        self.free -= size
        return block[offset:offset + nbytes].view(dtype).view(shape)
