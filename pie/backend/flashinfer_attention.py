"""Paged attention on CUDA through FlashInfer (0.6.18; an optional import).

Verified on one NVIDIA H200 (torch 2.11+cu130, 2026-11-26, benchmarks/cuda_check.sh):
tests/test_cuda.py holds all three paths to TorchPagedAttention on random pools (decode,
causal prefill, custom masks with hidden slots, scratch slots) and passes there; the H100
and other FlashInfer versions have not run it. `backend.attention = "auto"` picks it on
CUDA where it is installed (Engine.attention_choice).

The KV cache is then in its "nhd" layout (pie/backend/kv_cache.py), which FlashInfer's
paged kernels read in place. Per forward, one plan for every layer, one of three paths:

* decode — every item runs one new token and nothing is masked:
  `BatchDecodeWithPagedKVCacheWrapper`;
* prefill — anything else whose keys form a page table (`PagedIndex`):
  `BatchPrefillWithPagedKVCacheWrapper`, causal (bottom-right aligned, which is the plan's
  rule: key j is visible to new token i iff j <= n_context + i) or, where a page mask bit
  hides a key or an item has a custom mask, with the plan's dense masks flattened;
* ragged — keys that are not whole pages plus one partial page (new tokens on scratch
  slots, or a partial context page followed by new tokens on another page): each item's
  keys/values are gathered into a ragged buffer for `BatchPrefillWithRaggedKVCacheWrapper`,
  masks as above. Correct, but it copies the keys every layer.

A decode batch whose items begin with the same pages (`backend.shared_prefix_keys`, as on
the CPU: a shared system prompt, forks) runs as a cascade: each group's members attend to
its prefix together as one non-causal prefill item over those pages (the prefix read once
per group, not once per item), every item attends to the rest of its pages through the
decode kernel, and `flashinfer.merge_state` joins the two by their log-sum-exps. Decode
steps replayed from CUDA graphs (backend.cuda_graphs) keep the plain decode kernel. The
cascade was held to the reference on the same H200 on 2026-11-27
(test_flashinfer_cascade_over_shared_prefixes_matches_the_reference).

FlashInfer's kernels take fp16/bf16 (and fp8 KV), not fp32: with backend.dtype = float32
use attention = "torch".
"""

from __future__ import annotations

import torch

from pie.backend.attention import AttentionPlan
from pie.backend.kv_cache import KvCache
from pie.backend.paged_index import PagedIndex

WORKSPACE_BYTES = 128 * 2**20  # FlashInfer's recommended float workspace


class FlashInferAttention:
    # A cascade costs ~0.15-0.2 ms a layer in extra launches and copies; it pays where a
    # group's members x prefix keys reach ~1M (one H200, the default model's shape,
    # benchmarks/results/shared_prefix_attention-cuda.json: 512 users x 2,048 keys 1.2x,
    # 128 x 8,192 1.5x, 512 x 8,192 6x; 64 x 8,192 0.6x).
    SHARED_PREFIX_MEMBERS = 2
    SHARED_PREFIX_MIN_READ = 1 << 20  # members x prefix keys

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, shared_prefix_keys: int = 0):
        try:
            import flashinfer
        except ImportError as e:
            raise RuntimeError(
                "backend.attention = 'flashinfer' needs the flashinfer package (CUDA only); "
                "install it or use attention = 'torch'"
            ) from e
        if device.type != "cuda":
            raise RuntimeError("FlashInfer attention runs on CUDA only; use attention = 'torch'")
        if dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError(f"FlashInfer's kernels take fp16/bf16, not {dtype}; set "
                               "backend.dtype = 'bfloat16' or use attention = 'torch'")
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # One workspace for the three: a forward uses exactly one of them. The prefill
        # wrappers are pinned to FlashInfer's FA2 kernels: "auto" settles on a backend at a
        # wrapper's first plan and keeps it, so a first causal plan on Hopper would pick FA3,
        # which has no custom masks, for every later masked plan too.
        self.wrappers = {
            "decode": flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD"),
            "prefill": flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2"),
            "ragged": flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa2"),
        }
        # The cascade's prefix pass is planned beside the decode pass: a workspace of its own.
        self.shared = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD", backend="fa2")
        self.merge_state = flashinfer.merge_state
        self.shared_prefix_keys = shared_prefix_keys
        self.members: torch.Tensor | None = None  # the grouped items' rows, when a cascade runs
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.device = device
        self.dtype = dtype
        self.planned_for: AttentionPlan | None = None
        self.path = ""

    @staticmethod
    def choose(plan: AttentionPlan, page_size: int) -> tuple[str, PagedIndex | None]:
        """The path for `plan` (module docstring) and its page table (None for ragged)."""
        index = PagedIndex.from_plan(plan, page_size)
        if index is None:
            return "ragged", None
        return ("decode" if plan.is_decode else "prefill"), index

    def _plan(self, plan: AttentionPlan, page_size: int) -> None:
        self.path, index = self.choose(plan, page_size)
        wrapper = self.wrappers[self.path]
        shape = (self.heads, self.kv_heads, self.head_dim)
        types = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        if self.path == "decode":
            self.members = None
            groups = self._groups(index, page_size)
            if groups:
                self._plan_prefixes(index, groups, page_size)
                index = index.without_prefixes(groups)
            wrapper.plan(index.indptr, index.indices, index.last_page_len, *shape, page_size,
                         **types)
            return
        masks = None
        if plan.has_masks:
            masks = torch.cat([plan.item_mask(b).flatten() for b in range(plan.num_items)])
            masks = masks.to(plan.kv_slots.device)
        q_indptr = torch.tensor(plan.q_indptr, dtype=torch.int32)
        if self.path == "prefill":
            wrapper.plan(q_indptr, index.indptr, index.indices, index.last_page_len, *shape,
                         page_size, custom_mask=masks, causal=masks is None, **types)
        else:
            wrapper.plan(q_indptr, torch.tensor(plan.kv_indptr, dtype=torch.int32), *shape,
                         custom_mask=masks, causal=masks is None, **types)

    def _groups(self, index: PagedIndex, page_size: int) -> list[tuple[list[int], int]]:
        if not self.shared_prefix_keys:
            return []
        groups = index.shared_prefixes(-(-self.shared_prefix_keys // page_size), self.SHARED_PREFIX_MEMBERS)
        return [(members, n) for members, n in groups
                if len(members) * n * page_size >= self.SHARED_PREFIX_MIN_READ]

    def _plan_prefixes(self, index: PagedIndex, groups: list[tuple[list[int], int]], page_size: int) -> None:
        """One non-causal prefill item per group: its members' queries over its prefix pages."""
        pages = index.indices.tolist()
        starts = index.indptr.tolist()
        q_indptr, kv_indptr, indices, members = [0], [0], [], []
        for group, n in groups:
            members += group
            q_indptr.append(q_indptr[-1] + len(group))
            kv_indptr.append(kv_indptr[-1] + n)
            indices += pages[starts[group[0]] : starts[group[0]] + n]
        int32 = dict(dtype=torch.int32)
        self.shared.plan(torch.tensor(q_indptr, **int32), torch.tensor(kv_indptr, **int32),
                         torch.tensor(indices, **int32), torch.full((len(groups),), page_size, **int32),
                         self.heads, self.kv_heads, self.head_dim, page_size, causal=False,
                         q_data_type=self.dtype, kv_data_type=self.dtype)
        self.members = torch.tensor(members, dtype=torch.int64).to(self.device)

    def run(self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan) -> torch.Tensor:
        if self.planned_for is not plan:  # plan once per forward, reuse for every layer
            self._plan(plan, kv.page_size)
            self.planned_for = plan
        wrapper = self.wrappers[self.path]
        q = q.contiguous()  # a view into the fused qkv projection's output
        if self.path == "ragged":
            keys, values = kv.gather(layer, plan.kv_slots)
            return wrapper.run(q, keys, values)
        cache = (kv.keys[layer], kv.values[layer])
        if self.members is None:
            return wrapper.run(q, cache)
        out, lse = wrapper.run(q, cache, return_lse=True)  # each item's own pages
        shared, shared_lse = self.shared.run(q[self.members], cache, return_lse=True)
        out[self.members], _ = self.merge_state(out[self.members], lse[self.members], shared, shared_lse)
        return out
