"""The physical pools the backend owns: KV pages (with per-slot mask bits) and embed slots.

Slots are addressed flat: slot = page * page_size + offset. Behind the pages lie scratch
pages where a forward item that writes no KV page keeps its new tokens' keys/values for
the duration of that forward.

Layout per layer: keys [pages, kv_heads, head_dim, page_size] — transposed inside a page,
so the CPU kernel scores a whole page of keys with one vector per dimension (2x faster
than row-major keys, DESIGN §6) — and values [pages, kv_heads, page_size, head_dim].
"""

from __future__ import annotations

import math

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
        total_pages = num_pages + math.ceil(scratch_slots / page_size)
        k_shape = (total_pages, num_kv_heads, head_dim, page_size)
        v_shape = (total_pages, num_kv_heads, page_size, head_dim)
        self.keys = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # True = the slot is hidden from attention (mask_kvpage); cleared when a slot is written.
        self.masked = torch.zeros(total_pages * page_size, dtype=torch.bool, device=device)
        self.kernel = None  # on CPU, our C++ writer (see write)
        if device.type == "cpu":
            from pie.backend.kernels import paged_attention_module

            self.kernel = paged_attention_module()

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // self.page_size, slots % self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, head_dim] for the n slots. On CPU a serial C++ loop: torch's
        index assignment costs ~1.5 ms per layer at 32 slots when the other core is busy."""
        dtype = self.keys[layer].dtype
        if self.kernel is not None:
            self.kernel.write_kv(self.keys[layer], self.values[layer], slots,
                                 k.to(dtype).contiguous(), v.to(dtype).contiguous())
            return
        page, offset = self._split(slots)
        self.keys[layer][page, :, :, offset] = k.to(dtype)
        self.values[layer][page, :, offset, :] = v.to(dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of `slots`, each [n, kv_heads, head_dim]."""
        page, offset = self._split(slots)
        return self.keys[layer][page, :, :, offset], self.values[layer][page, :, offset, :]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src_page, src_offset = self._split(src)
        dst_page, dst_offset = self._split(dst)
        for keys, values in zip(self.keys, self.values):
            keys[dst_page, :, :, dst_offset] = keys[src_page, :, :, src_offset]
            values[dst_page, :, dst_offset, :] = values[src_page, :, src_offset, :]
        self.masked[dst] = self.masked[src]


class EmbedPool:
    """Embedding vectors with the position each was created at (RoPE reads it in forward)."""

    def __init__(self, num_embeds: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.size = num_embeds
        self.vectors = torch.zeros((num_embeds, hidden_size), dtype=dtype, device=device)
        self.positions = torch.zeros(num_embeds, dtype=torch.int64, device=device)
