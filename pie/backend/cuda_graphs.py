"""CUDA graphs for decode steps (`backend.cuda_graphs = true`).

Verified on one NVIDIA H200 (2026-11-26, benchmarks/cuda_check.sh): greedy tokens with
graphs equal those without, padded buckets and the eager fallback included
(tests/test_cuda.py); the decode step took 4.7 / 6.8 / 9.3 ms at batch 1 / 8 / 32 against
30.7 / 30.1 / 32.0 ms eager (context 128, benchmarks/results/backend-cuda*.json).

Why: a decode step of a small model on a GPU is bound by kernel launches, not arithmetic:
~30 layers of a dozen kernels, each launched from Python (on that machine's slow host CPU,
~30 ms a step whatever the batch). A captured graph replays the whole forward with one launch.

How: at start, the decode forward (`Llama.forward` with FlashInfer's decode kernel in its
CUDA-graph mode) is captured once per batch-size bucket — 1, 2, 4, ... up to
min(MAX_BUCKET, backend.max_batch_tokens) — on static buffers: input vectors, positions,
KV write slots and, per bucket, the decode wrapper's page-table buffers. A step of n items
copies its inputs into the buffers, pads to the next bucket with rows that write to and
read from the KV cache's padding page (`KvCache.pad_page`, which no item writes), plans
that bucket's wrapper (FlashInfer's plan() runs outside the graph and rewrites the buffers
the graph reads), replays, and returns the real rows.

`forward` returns None — and the engine runs the step eagerly, as without graphs — for a
batch that is not a plain decode step (an item with several new tokens, a custom mask, a
hidden slot), has more items than the largest bucket, has keys that are not a page table
(`PagedIndex`), or references more pages than the index buffer holds.
"""

from __future__ import annotations

import math

import torch

from pie.backend.attention import AttentionPlan
from pie.backend.flashinfer_attention import WORKSPACE_BYTES
from pie.backend.kv_cache import KvCache
from pie.backend.llama import Llama
from pie.backend.paged_index import PagedIndex


class DecodeGraphs:
    """Captured decode forwards, one per bucket; also the PagedAttention they capture."""

    MAX_BUCKET = 256  # larger decode batches run eagerly, where a launch costs less per token

    @classmethod
    def buckets(cls, max_batch_tokens: int) -> list[int]:
        """Powers of two up to min(MAX_BUCKET, max_batch_tokens) (a decode item is one token)."""
        cap = min(cls.MAX_BUCKET, max_batch_tokens)
        return [1 << i for i in range(cap.bit_length())]

    @staticmethod
    def bucket_for(items: int, sizes: list[int]) -> int | None:
        """The smallest bucket that holds `items`, or None (the batch runs eagerly)."""
        return next((size for size in sizes if size >= items), None)

    def __init__(self, model: Llama, kv: KvCache, max_batch_tokens: int):
        import flashinfer

        if kv.pad_page is None:
            raise ValueError("CUDA graphs need the KV cache's 'nhd' layout (its padding page)")
        cfg = model.config
        self.model, self.kv = model, kv
        self.sizes = self.buckets(max_batch_tokens)
        largest, device = self.sizes[-1], kv.keys[0].device
        self.pad_slot = kv.pad_page * kv.page_size
        self.x = torch.zeros(largest, cfg.hidden_size, dtype=model.dtype, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.write_slots = torch.full((largest,), self.pad_slot, dtype=torch.int64, device=device)
        self.rows = torch.arange(largest, device=device)
        self.max_pages = largest * math.ceil(cfg.max_position_embeddings / kv.page_size)
        # Buffers shared by every bucket: one graph replays at a time, right after its plan.
        workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        indices = torch.zeros(self.max_pages, dtype=torch.int32, device=device)
        self.wrappers = {size: flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True,
            paged_kv_indptr_buffer=torch.zeros(size + 1, dtype=torch.int32, device=device),
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=torch.zeros(size, dtype=torch.int32, device=device),
        ) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.size = 0  # the bucket whose wrapper `run` calls (set while capturing)
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: the others reuse its memory
            self._capture(size, pool)

    def _plan(self, size: int, index: PagedIndex) -> None:
        cfg = self.model.config
        self.wrappers[size].plan(index.indptr, index.indices, index.last_page_len, cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim, self.kv.page_size,
                                 q_data_type=self.model.dtype, kv_data_type=self.model.dtype)

    def _capture(self, size: int, pool) -> None:
        slots = self.write_slots[:size]  # every row on the padding slot
        ones = list(range(size + 1))
        plan = AttentionPlan(ones, ones, slots.clone(), torch.ones_like(slots, dtype=torch.bool),
                             [None] * size)
        self._plan(size, PagedIndex.from_plan(plan, self.kv.page_size))
        self.size = size

        def step() -> torch.Tensor:
            return self.model.forward(self.x[:size], self.positions[:size], slots, plan, self,
                                      self.kv, self.rows[:size])

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # warm-up outside the graph (FlashInfer's JIT, cuBLAS handles)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = step()
        self.graphs[size] = graph

    def run(self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan) -> torch.Tensor:
        """PagedAttention for the captured forward: the current bucket's decode wrapper."""
        return self.wrappers[self.size].run(q.contiguous(), (kv.keys[layer], kv.values[layer]))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                plan: AttentionPlan, out_rows: torch.Tensor) -> torch.Tensor | None:
        """`Llama.forward`'s result for a decode batch, by replay; None where the batch must
        run eagerly (module docstring)."""
        n = plan.num_items
        size = self.bucket_for(n, self.sizes)
        if size is None or not plan.is_decode:
            return None
        index = PagedIndex.from_plan(plan, self.kv.page_size)
        if index is None or len(index.indices) + size - n > self.max_pages:
            return None
        self._plan(size, index.padded(size, self.kv.pad_page))
        self.x[:n].copy_(x)
        self.positions[:n].copy_(positions)
        self.write_slots[:n].copy_(write_slots)
        self.write_slots[n:size].fill_(self.pad_slot)  # a larger batch left real slots there
        self.graphs[size].replay()
        return self.outputs[size][out_rows]
