"""Paged attention on CUDA through FlashInfer — UNVERIFIED: it has never run on a GPU.

Kept behind `backend.attention = "flashinfer"` and an optional import until a GPU machine
runs the test suite with it. Each item's keys/values are gathered into a ragged buffer and
attended with FlashInfer's ragged prefill kernel; page mask bits and custom masks become
FlashInfer's flattened custom mask, otherwise its (bottom-right aligned) causal mode is used,
which matches the plan's causal rule.
"""

from __future__ import annotations

import torch

from pie.backend.attention import AttentionPlan
from pie.backend.kv_cache import KvCache


class FlashInferAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device):
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(
                "backend.attention = 'flashinfer' needs the flashinfer package (CUDA only); "
                "install it or use attention = 'torch'"
            ) from e
        if device.type != "cuda":
            raise RuntimeError("FlashInfer attention runs on CUDA only; use attention = 'torch'")
        workspace = torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.planned_for: AttentionPlan | None = None

    def _plan(self, plan: AttentionPlan, dtype: torch.dtype) -> None:
        device = plan.kv_slots.device
        needs_mask = any(m is not None for m in plan.custom_masks) or not bool(plan.kv_visible.all())
        custom = None
        if needs_mask:
            custom = torch.cat([plan.item_mask(b).flatten() for b in range(plan.num_items)]).to(device)
        self.wrapper.plan(
            torch.tensor(plan.q_indptr, dtype=torch.int32, device=device),
            torch.tensor(plan.kv_indptr, dtype=torch.int32, device=device),
            self.heads, self.kv_heads, self.head_dim,
            custom_mask=custom, causal=not needs_mask, q_data_type=dtype, kv_data_type=dtype,
        )
        self.planned_for = plan

    def run(self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan) -> torch.Tensor:
        if self.planned_for is not plan:  # plan once per forward, reuse for every layer
            self._plan(plan, q.dtype)
        keys, values = kv.gather(layer, plan.kv_slots)
        return self.wrapper.run(q, keys, values)
