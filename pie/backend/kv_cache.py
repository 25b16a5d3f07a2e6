"""The physical pools the backend owns: KV pages (with per-slot mask bits) and embed slots.

Slots are addressed flat: slot = page * page_size + offset. Behind the pages lie scratch
pages where a forward item that writes no KV page keeps its new tokens' keys/values for
the duration of that forward; in the "nhd" layout one more page that no item writes, where
CUDA graph padding rows write and read (pie/backend/cuda_graphs.py).

Two layouts per layer, chosen by device (or explicitly, as tests do):
* "cpu": keys [pages, kv_heads, head_dim, page_size] — transposed inside a page, so the CPU
  kernel scores a whole page of keys with one vector per dimension (2x faster than
  row-major keys, DESIGN §6) — and values [pages, kv_heads, page_size, head_dim];
* "nhd" (CUDA): keys and values each [pages, page_size, kv_heads, head_dim], the paged
  layout FlashInfer's kernels read in place (its "NHD" with separate K and V tensors); a
  slot is then one row of the tensor viewed as [slots, kv_heads, head_dim].
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
        layout: str | None = None,
    ):
        """layout: "cpu" or "nhd" (module docstring); None = "cpu" on CPU, "nhd" elsewhere."""
        self.layout = layout or ("cpu" if device.type == "cpu" else "nhd")
        if self.layout not in ("cpu", "nhd"):
            raise ValueError(f"KV layout {self.layout!r} is not 'cpu' or 'nhd'")
        self.num_pages, self.page_size = num_pages, page_size
        self.scratch_start = num_pages * page_size
        # The scratch cursor stays below scratch_start + scratch_slots, so the page after the
        # scratch pages is never written by an item. Only "nhd" has it (CUDA graphs need it).
        scratch_end = num_pages + math.ceil(scratch_slots / page_size)
        self.pad_page = scratch_end if self.layout == "nhd" else None
        total_pages = scratch_end + (self.pad_page is not None)
        if self.layout == "cpu":
            k_shape = (total_pages, num_kv_heads, head_dim, page_size)
            v_shape = (total_pages, num_kv_heads, page_size, head_dim)
        else:
            k_shape = v_shape = (total_pages, page_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(k_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(num_layers)]
        # True = the slot is hidden from attention (mask_kvpage); cleared when a slot is written.
        self.masked = torch.zeros(total_pages * page_size, dtype=torch.bool, device=device)
        self.kernel = None  # on CPU, our C++ writer (see write)
        if device.type == "cpu" and self.layout == "cpu":
            from pie.backend.kernels import paged_attention_module

            self.kernel = paged_attention_module()

    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // self.page_size, slots % self.page_size

    @staticmethod
    def _rows(pool: torch.Tensor) -> torch.Tensor:
        """An "nhd" pool as [slots, kv_heads, head_dim] (a view: slot = row)."""
        return pool.view(-1, *pool.shape[2:])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [n, kv_heads, head_dim] for the n slots. On CPU a serial C++ loop: torch's
        index assignment costs ~1.5 ms per layer at 32 slots when the other core is busy.
        In "nhd" one index_copy_ per pool, which a CUDA graph can capture."""
        dtype = self.keys[layer].dtype
        if self.kernel is not None:
            self.kernel.write_kv(self.keys[layer], self.values[layer], slots,
                                 k.to(dtype).contiguous(), v.to(dtype).contiguous())
        elif self.layout == "nhd":
            self._rows(self.keys[layer]).index_copy_(0, slots, k.to(dtype))
            self._rows(self.values[layer]).index_copy_(0, slots, v.to(dtype))
        else:
            page, offset = self._split(slots)
            self.keys[layer][page, :, :, offset] = k.to(dtype)
            self.values[layer][page, :, offset, :] = v.to(dtype)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values of `slots`, each [n, kv_heads, head_dim]."""
        if self.layout == "nhd":
            return self._rows(self.keys[layer])[slots], self._rows(self.values[layer])[slots]
        page, offset = self._split(slots)
        return self.keys[layer][page, :, :, offset], self.values[layer][page, :, offset, :]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        src_page, src_offset = self._split(src)
        dst_page, dst_offset = self._split(dst)
        for keys, values in zip(self.keys, self.values):
            if self.layout == "nhd":
                for pool in (keys, values):
                    self._rows(pool)[dst] = self._rows(pool)[src]
            else:
                keys[dst_page, :, :, dst_offset] = keys[src_page, :, :, src_offset]
                values[dst_page, :, dst_offset, :] = values[src_page, :, src_offset, :]
        self.masked[dst] = self.masked[src]

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Whole pages (K, V and mask bits), src[i] -> dst[i]: one block copy per page and
        pool, where `copy_slots` gathers slot by slot (94 pages of the default model in bf16:
        ~10 ms against ~16 ms, Xeon 2 vCPU)."""
        for pool in self.keys + self.values:
            pool[dst] = pool[src]
        pages = self.masked.view(-1, self.page_size)
        pages[dst] = pages[src]


class EmbedPool:
    """Embedding vectors with the position each was created at (RoPE reads it in forward)."""

    def __init__(self, num_embeds: int, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.size = num_embeds
        self.vectors = torch.zeros((num_embeds, hidden_size), dtype=dtype, device=device)
        self.positions = torch.zeros(num_embeds, dtype=torch.int64, device=device)
