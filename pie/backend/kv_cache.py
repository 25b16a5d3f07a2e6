"""The physical pools the backend owns: KV pages (with per-slot mask bits) and embed slots.

Slots are addressed flat: slot = page * page_size + offset. Behind the pages lie
`scratch_slots` extra slots where a forward item that writes no KV page keeps its new
tokens' keys/values for the duration of that forward.
"""

from __future__ import annotations

import torch


class KvCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        scratch_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_start = num_pages * page_size
        total = self.scratch_start + scratch_slots
        shape = (total, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # True = the slot is hidden from attention (mask_kvpage); cleared when a slot is written.
        self.masked = torch.zeros(total, dtype=torch.bool, device=device)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys[layer].index_copy_(0, slots, k.to(self.keys[layer].dtype))
        self.values[layer].index_copy_(0, slots, v.to(self.values[layer].dtype))

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for keys, values in zip(self.keys, self.values):
            keys[dst] = keys[src]
            values[dst] = values[src]
        self.masked[dst] = self.masked[src]


class EmbedPool:
    """Embedding vectors with the position each was created at (RoPE reads it in forward)."""

    def __init__(self, num_embeds: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.size = num_embeds
        self.vectors = torch.zeros((num_embeds, hidden_size), dtype=dtype, device=device)
        self.positions = torch.zeros(num_embeds, dtype=torch.int64, device=device)
