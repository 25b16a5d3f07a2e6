"""Paged attention: which cached slots each new token sees, and the kernels that attend.

A forward batch is described once by an `AttentionPlan` (shared by all layers). Item b owns
queries `q_indptr[b]:q_indptr[b+1]` of the batch and keys `kv_indptr[b]:kv_indptr[b+1]` of
`kv_slots` — its context slots followed by its new tokens' slots. Key j of item b is visible
to its query i iff `kv_visible[j]` (page mask bits) and either the item's custom mask allows
it or, without one, j < n_context + i + 1 (causal over the new tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class AttentionPlan:
    q_indptr: list[int]
    kv_indptr: list[int]
    kv_slots: torch.Tensor  # int64 [total keys]
    kv_visible: torch.Tensor  # bool [total keys]
    custom_masks: list[torch.Tensor | None]  # per item: bool [n_new, n_keys] or None

    @property
    def num_items(self) -> int:
        return len(self.q_indptr) - 1

    def item_mask(self, b: int) -> torch.Tensor:
        """Dense bool [n_new, n_keys] visibility of item b (reference path and tests)."""
        n_new = self.q_indptr[b + 1] - self.q_indptr[b]
        n_keys = self.kv_indptr[b + 1] - self.kv_indptr[b]
        visible = self.kv_visible[self.kv_indptr[b] : self.kv_indptr[b + 1]]
        custom = self.custom_masks[b]
        if custom is None:
            n_context = n_keys - n_new
            rows = torch.arange(n_new, device=visible.device)[:, None]
            cols = torch.arange(n_keys, device=visible.device)[None, :]
            custom = cols <= rows + n_context
        return custom & visible[None, :]


class PagedAttention(Protocol):
    def run(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """q: [T, heads, D]; keys/values: one layer's pool [slots, kv_heads, D] → [T, heads, D]."""
        ...


class TorchPagedAttention:
    """Pure PyTorch: per item, gather its keys/values and run SDPA in fp32.

    fp32 math because bf16 SDPA is ~8x slower on CPU (DESIGN §6); it also is the exact
    reference the faster kernels are tested against.
    """

    def run(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        for b in range(plan.num_items):
            q0, q1 = plan.q_indptr[b], plan.q_indptr[b + 1]
            slots = plan.kv_slots[plan.kv_indptr[b] : plan.kv_indptr[b + 1]]
            k = keys[slots].float().transpose(0, 1)  # [kv_heads, L, D]
            v = values[slots].float().transpose(0, 1)
            qb = q[q0:q1].float().transpose(0, 1)  # [heads, n, D]
            o = F.scaled_dot_product_attention(
                qb, k, v, attn_mask=plan.item_mask(b), enable_gqa=True
            )
            out[q0:q1] = o.transpose(0, 1).to(q.dtype)
        return out
