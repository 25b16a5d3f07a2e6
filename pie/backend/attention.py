"""Paged attention: which cached slots each new token sees, and the kernels that attend.

A forward batch is described once by an `AttentionPlan` (shared by all layers). Item b owns
queries `q_indptr[b]:q_indptr[b+1]` of the batch and keys `kv_indptr[b]:kv_indptr[b+1]` of
`kv_slots` — its context slots followed by its new tokens' slots. Key j of item b is visible
to its query i iff `kv_visible[j]` (page mask bits) and either the item's custom mask allows
it or, without one, j < n_context + i + 1 (causal over the new tokens).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from pie.backend.dtype import cpu_flags
from pie.backend.kv_cache import KvCache


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

    @property
    def longest(self) -> int:
        """The most new tokens of one item."""
        return max((self.q_indptr[b + 1] - self.q_indptr[b] for b in range(self.num_items)), default=0)

    @property
    def has_masks(self) -> bool:
        """Whether some key is hidden (a page mask bit) or some item has a custom mask."""
        return any(m is not None for m in self.custom_masks) or not bool(self.kv_visible.all())

    @property
    def is_decode(self) -> bool:
        """One new token per item and no masks: a step FlashInfer's decode kernel can run,
        and the shape a captured CUDA graph replays (pie/backend/cuda_graphs.py)."""
        return all(self.q_indptr[b + 1] - self.q_indptr[b] == 1 for b in range(self.num_items)) \
            and not self.has_masks

    def starts_causal(self, b: int) -> bool:
        """Whether item b is a prompt from its first token with nothing hidden: its visibility
        is SDPA's own `is_causal` rule (key j visible to new token i iff j <= i)."""
        n_new = self.q_indptr[b + 1] - self.q_indptr[b]
        n_keys = self.kv_indptr[b + 1] - self.kv_indptr[b]
        return n_new == n_keys and self.custom_masks[b] is None \
            and bool(self.kv_visible[self.kv_indptr[b] : self.kv_indptr[b + 1]].all())

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
    def run(self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan) -> torch.Tensor:
        """q: [T, heads, D] → [T, heads, D], attending to layer `layer` of the KV pools."""
        ...


class TorchPagedAttention:
    """Pure PyTorch: per item, gather its keys/values and run SDPA in fp32.

    fp32 math because bf16 SDPA is ~8x slower on CPU (DESIGN §6); it also is the exact
    reference the faster kernels are tested against.
    """

    def run(self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan) -> torch.Tensor:
        out = torch.empty_like(q)
        for b in range(plan.num_items):
            out[plan.q_indptr[b] : plan.q_indptr[b + 1]] = self.attend_item(q, kv, layer, plan, b)
        return out

    def attend_item(
        self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan, b: int
    ) -> torch.Tensor:
        keys, values = kv.gather(layer, plan.kv_slots[plan.kv_indptr[b] : plan.kv_indptr[b + 1]])
        k = keys.float().transpose(0, 1)  # [kv_heads, L, D]
        v = values.float().transpose(0, 1)
        qb = q[plan.q_indptr[b] : plan.q_indptr[b + 1]].float().transpose(0, 1)  # [heads, n, D]
        # 4-D inputs: only then does CPU SDPA take its fused (flash) kernel, masks and GQA
        # included; 3-D inputs fall back to the math path (~4x slower on a long prefill).
        # A prompt from its start needs no mask: `is_causal` lets the kernel skip the blocks
        # above the diagonal, which a dense mask makes it compute and then hide. Same output,
        # bit for bit; one layer (9 heads, 3 KV heads, fp32, AMD EPYC, 2 vCPUs): 12.7 -> 11.5
        # ms at 512 tokens, 183 -> 109 ms at 2,000.
        if plan.starts_causal(b):
            o = F.scaled_dot_product_attention(qb[None], k[None], v[None], is_causal=True, enable_gqa=True)[0]
        else:
            o = F.scaled_dot_product_attention(qb[None], k[None], v[None],
                                               attn_mask=plan.item_mask(b), enable_gqa=True)[0]
        return o.transpose(0, 1).to(q.dtype)


class CpuKernelAttention:
    """Our C++ kernel (`csrc/paged_attention.cpp`) for items with few new tokens — decode
    steps, speculative drafts, and on CPUs without AVX-512 BF16 short prompts
    (`default_kernel_pairs`) — which read the pool in place; items with many new tokens
    (prefill) go through SDPA, whose blocked kernel beats a per-query loop there. In bf16 on
    a CPU with AVX-512 BF16, a prefill item that sees every key of its context causally (no page mask bit, no custom mask) goes instead to a
    flash-attention loop in bf16 dot products (`csrc/prompt_attention.h`): one layer at 512
    tokens 2.2 against SDPA's 5.3 ms, 850 new tokens after 16 cached 5.3 against 17.0 (AMD
    EPYC Zen 4, 2 vCPUs, one-off; docs/backend.md); its probabilities are rounded to bf16 before they weight
    the values, so it is held to the reference within bf16 rounding (tests/test_attention.py).

    Decode items whose contexts begin with the same pages (a shared system prompt, forks of
    one context) of at least `shared_prefix_keys` keys attend to that prefix together, over
    one copy of it (csrc/shared_prefix.h: with bf16 pools and AVX-512 BF16 the prompt kernel's
    flash loop, else fp32 matrix products); 0 turns that off. It takes groups of at least
    SHARED_PREFIX_MEMBERS, where one layer's attention over a shared prefix turns faster
    (fp32 products, benchmarks/results/shared_prefix_attention.json, Xeon, 2026-11-27: 4 users
    0.72x on 512 and on 2,048 keys, 8 users 1.19x and 1.05x, 32 users 1.59x and 1.80x; the
    flash loop, epyc-zen4/shared_prefix_attention.json, 2026-12-02: 4 users 0.98x and 1.11x,
    8 users 1.58x and 2.32x, 32 users 2.29x and 2.49x; the copy of the prefix is the fixed cost).
    """

    PREFILL_TOKENS = 32  # measured crossover between the kernel and gather + SDPA (Xeon, AVX-512)
    # On a CPU with AVX2 and no AVX-512 the kernel also takes items of up to this many
    # query-key pairs (new tokens x their average visible keys): there SDPA costs ~0.5 ms an
    # item and a layer before its ~100 ns a pair, the kernel ~118 ns a pair and nothing fixed.
    # A 512-token prefill batch's attention (30 layers, AMD EPYC, 2 vCPUs): 8 prompts of 64
    # tokens 135 -> 69 ms, 4 of 128 183 -> 115, 2 of 256 236 -> 193; one of 512 (131k pairs)
    # stays with SDPA (412 against the kernel's 465).
    AVX2_KERNEL_PAIRS = 40_000
    # With AVX-512 and no BF16 (Ice Lake Xeon, family 6 model 106, 2 vCPUs, 2026-12-07; whole
    # steps, the two rules alternating in one process, 22 pairs each): one 128-token prompt
    # (8,192 pairs) 0.98x SDPA's step time, beside 24 decoders 0.95x, 4 of them 0.95x, 2 of 64
    # tokens beside 24 decoders 0.95x (22 of 22 pairs); 192 tokens (18,432) 1.02x, 256 1.01x.
    AVX512_KERNEL_PAIRS = 12_000
    NO_GROUPS = torch.zeros(1, dtype=torch.int64)  # shared-prefix groups: none (read only)
    SHARED_PREFIX_MEMBERS = 8

    def __init__(self, shared_prefix_keys: int = 0, kernel_pairs: int | None = None) -> None:
        """`kernel_pairs`: the most query-key pairs of an item past PREFILL_TOKENS new tokens
        that the kernel takes (default: `default_kernel_pairs()`)."""
        from pie.backend.kernels import paged_attention_module

        self.kernel = paged_attention_module()
        if kernel_pairs is None:
            kernel_pairs = self.default_kernel_pairs(cpu_flags())
        self.kernel_pairs = kernel_pairs
        self.reference = TorchPagedAttention()
        self.shared_prefix_keys = shared_prefix_keys
        self.grouped_items = 0  # decode items that attended to a shared prefix, all forwards
        self.scratch = torch.empty(0)  # the shared-prefix path's buffers, grown by the kernel
        self.prepared_for: AttentionPlan | None = None
        self.prompt_items = 0  # prefill items that took prompt_attention, all forwards

    def _prepare(self, plan: AttentionPlan, page_size: int) -> None:
        """Kernel arguments derived from the plan once per forward, reused by every layer."""
        sizes = [plan.q_indptr[b + 1] - plan.q_indptr[b] for b in range(plan.num_items)]
        keys = [plan.kv_indptr[b + 1] - plan.kv_indptr[b] for b in range(plan.num_items)]
        kernel = [n <= self.PREFILL_TOKENS or n * (k - n / 2) <= self.kernel_pairs for n, k in zip(sizes, keys)]
        self.enabled = torch.tensor(kernel)
        self.prefill_items = [b for b, taken in enumerate(kernel) if not taken]
        offsets, masks, total = [], [], 0
        for mask in plan.custom_masks:
            offsets.append(-1 if mask is None else total)
            if mask is not None:
                masks.append(mask.flatten())
                total += mask.numel()
        self.mask_offsets = torch.tensor(offsets, dtype=torch.int64)
        self.masks = torch.cat(masks) if masks else torch.zeros(1, dtype=torch.bool)
        self.q_indptr = torch.tensor(plan.q_indptr, dtype=torch.int64)
        self.kv_indptr = torch.tensor(plan.kv_indptr, dtype=torch.int64)
        self.groups = self.NO_GROUPS
        if self.shared_prefix_keys and len(sizes) > 1:
            self.groups = self.kernel.shared_prefixes(
                self.q_indptr, self.kv_indptr, plan.kv_slots, plan.kv_visible, self.mask_offsets,
                self.enabled, page_size, self.shared_prefix_keys, self.SHARED_PREFIX_MEMBERS)
            self.grouped_items += members_of(self.groups.tolist())
        self.prompt_takes: dict[int, bool] = {}  # prefill item -> takes prompt_attention
        # The kernel's rows where prefill items are beside them: their queries alone, with
        # an empty row range for each prefill item (whose rows the prompt loop writes), so
        # the kernel does not convert, zero and convert back every prompt row each layer
        # (a 512-token prompt: ~10 ms a forward, AMD EPYC Zen 5). Not with shared-prefix
        # groups, which address queries by the full layout.
        self.kernel_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, their q_indptr)
        if self.prefill_items and self.groups is self.NO_GROUPS:
            taken = [torch.arange(plan.q_indptr[b], plan.q_indptr[b + 1]) for b, t in enumerate(kernel) if t]
            own_indptr = [0, *itertools.accumulate(n if t else 0 for n, t in zip(sizes, kernel))]
            self.kernel_rows = (torch.cat(taken) if taken else torch.zeros(0, dtype=torch.int64),
                                torch.tensor(own_indptr, dtype=torch.int64))
        self.prepared_for = plan

    def kernel_args(self, plan: AttentionPlan, kv: KvCache) -> tuple[torch.Tensor, ...]:
        """The kernel's arguments after the pools: q_indptr, kv_indptr, kv_slots, kv_visible,
        mask_offsets, masks, enabled, shared-prefix groups, scratch (pie/backend/decode_step.py
        passes them too)."""
        if self.prepared_for is not plan:
            self._prepare(plan, kv.page_size)
        return (self.q_indptr, self.kv_indptr, plan.kv_slots, plan.kv_visible, self.mask_offsets,
                self.masks, self.enabled, self.groups, self.scratch)

    @classmethod
    def default_kernel_pairs(cls, flags: frozenset[str] | set[str]) -> int:
        """AVX2_KERNEL_PAIRS on a CPU with AVX2 and no AVX-512, AVX512_KERNEL_PAIRS on one with
        AVX-512 and no BF16; none where AVX-512 BF16 is (bf16 prompts take prompt_attention)."""
        if "avx512f" not in flags:
            return cls.AVX2_KERNEL_PAIRS if "avx2" in flags else 0
        return 0 if "avx512_bf16" in flags else cls.AVX512_KERNEL_PAIRS

    def run(self, q: torch.Tensor, kv: KvCache, layer: int, plan: AttentionPlan) -> torch.Tensor:
        args = self.kernel_args(plan, kv)
        scale = 1.0 / math.sqrt(q.shape[-1])
        if self.kernel_rows is None:
            out = self.kernel.paged_attention(q.float().contiguous(), kv.keys[layer], kv.values[layer], *args,
                                              scale).to(q.dtype)
        else:  # beside prefill items: the kernel's items over their own rows only
            rows, own_indptr = self.kernel_rows
            out = torch.empty_like(q)
            if len(rows):
                out[rows] = self.kernel.paged_attention(q[rows].float(), kv.keys[layer], kv.values[layer],
                                                        own_indptr, *args[1:], scale).to(q.dtype)
        for b in self.prefill_items:
            q0, q1 = plan.q_indptr[b], plan.q_indptr[b + 1]
            if self._prompt_kernel(q, kv, plan, b):
                k0, k1 = plan.kv_indptr[b], plan.kv_indptr[b + 1]
                out[q0:q1] = self.kernel.prompt_attention(
                    q[q0:q1].contiguous(), kv.keys[layer], kv.values[layer], plan.kv_slots[k0:k1],
                    (k1 - k0) - (q1 - q0), scale)
                self.prompt_items += layer == 0
            else:
                out[q0:q1] = self.reference.attend_item(q, kv, layer, plan, b)
        return out

    def _prompt_kernel(self, q: torch.Tensor, kv: KvCache, plan: AttentionPlan, b: int) -> bool:
        """Whether prefill item b takes prompt_attention (`takes_prompt_kernel`, over a bf16
        pool): decided at the forward's first layer, the same at every other."""
        if b not in self.prompt_takes:
            self.prompt_takes[b] = kv.keys[0].dtype == torch.bfloat16 and takes_prompt_kernel(
                self.kernel, q, kv.keys[0].shape[1], plan.custom_masks[b],
                plan.kv_visible[plan.kv_indptr[b]:plan.kv_indptr[b + 1]])
        return self.prompt_takes[b]


def takes_prompt_kernel(module, q: torch.Tensor, kv_heads: int, mask: torch.Tensor | None,
                        visible: torch.Tensor) -> bool:
    """Whether a prefill item's attention goes to the kernel module's prompt_attention: bf16
    queries on CPU, heads and a head size it has, and causal visibility of every key (no
    custom mask, no hidden key). One rule for the one-shot forward and chunked_forward.py,
    so a chunked item gives the one-shot bits."""
    return (q.dtype == torch.bfloat16 and q.device.type == "cpu" and mask is None
            and module.prompt_attention_supports(q.shape[1], kv_heads, q.shape[2]) and bool(visible.all()))


def members_of(groups: list[int]) -> int:
    """How many items the shared-prefix groups hold ([n, then per group: n_pages, n_members,
    members..., pages...], csrc/shared_prefix.h's layout)."""
    total, at = 0, 1
    for _ in range(groups[0]):
        total += groups[at + 1]
        at += 2 + groups[at + 1] + groups[at]
    return total
