"""Shared-prefix decode attention (csrc/shared_prefix.h) against the pure-PyTorch reference:
which decode items are grouped, over how many pages, and that the merged result equals
attending to each item's keys one by one."""

from __future__ import annotations

import pytest
import torch

from pie.backend.attention import AttentionPlan, CpuKernelAttention, TorchPagedAttention
from tests.test_attention import random_pool


def plan_of(items: list[tuple[list[int], list[int], int]], page_size: int) -> AttentionPlan:
    """Items of (context pages, extra context slots, new tokens): keys are the pages' slots in
    order, then the extra slots, then one fresh slot per new token (taken from the top of the
    pool, page 199 downwards)."""
    q_indptr, kv_indptr, slots, masks = [0], [0], [], []
    fresh = 200 * page_size
    for pages, extra, n_new in items:
        own = list(range(fresh - n_new, fresh))
        fresh -= n_new
        keys = [p * page_size + o for p in pages for o in range(page_size)] + extra + own
        slots += keys
        q_indptr.append(q_indptr[-1] + n_new)
        kv_indptr.append(kv_indptr[-1] + len(keys))
        masks.append(None)
    return AttentionPlan(q_indptr, kv_indptr, torch.tensor(slots),
                         torch.ones(len(slots), dtype=torch.bool), masks)


def kernel_of(shared_prefix_keys: int, min_members: int = 2) -> CpuKernelAttention:
    """The kernel with groups of two and more (the default minimum is set for speed)."""
    kernel = CpuKernelAttention(shared_prefix_keys)
    kernel.SHARED_PREFIX_MEMBERS = min_members
    return kernel


def groups_of(flat: list[int]) -> list[tuple[list[int], list[int]]]:
    """find_groups' flat layout as (members, pages) pairs, sorted."""
    out, at = [], 1
    for _ in range(flat[0]):
        n_pages, n_members = flat[at], flat[at + 1]
        members = flat[at + 2 : at + 2 + n_members]
        pages = flat[at + 2 + n_members : at + 2 + n_members + n_pages]
        out.append((sorted(members), pages))
        at += 2 + n_members + n_pages
    return sorted(out)


SYSTEM = list(range(10, 22))  # a 12-page system prompt
ITEMS = [
    (SYSTEM, [], 1),  # 0: the prompt alone
    (SYSTEM + [40, 41], [], 1),  # 1: the prompt and its own pages
    (SYSTEM + [42], [700, 705, 3], 1),  # 2: ... and scattered own slots
    (SYSTEM[:8] + [50, 51], [], 1),  # 3: shares 8 of the 12 pages
    (SYSTEM, [], 3),  # 4: a draft of 3 tokens: not a decode item
    ([60, 61, 62, 63], [], 1),  # 5: nothing shared
    ([60, 61, 62, 63, 64], [], 1),  # 6: shares 4 pages with item 5
    ([90], [], 1),  # 7: one page, below the minimum
    ([90], [], 1),  # 8
]


def test_groups_take_the_common_whole_pages_of_decode_items():
    kernel = kernel_of(48)
    plan = plan_of(ITEMS, 16)
    flat = kernel.kernel_args(plan, random_pool(torch.Generator(), 200, 16, 3, 64, torch.float32))[7]
    assert groups_of(flat.tolist()) == [([0, 1, 2, 3], SYSTEM[:8]), ([5, 6], [60, 61, 62, 63])]
    assert kernel.grouped_items == 6


def test_no_groups_when_off_alone_or_too_few():
    kv = random_pool(torch.Generator(), 200, 16, 3, 64, torch.float32)
    assert kernel_of(0).kernel_args(plan_of(ITEMS, 16), kv)[7].tolist() == [0]
    assert kernel_of(16).kernel_args(plan_of(ITEMS[:1], 16), kv)[7].tolist() == [0]
    assert groups_of(kernel_of(48, 3).kernel_args(plan_of(ITEMS, 16), kv)[7].tolist()) == [([0, 1, 2, 3], SYSTEM[:8])]


def test_a_hidden_or_masked_prefix_key_leaves_the_item_out():
    """A member must see every prefix key the same way: an item with a page mask bit cleared
    in the prefix, or with a custom mask, attends on its own."""
    plan = plan_of(ITEMS[:4], 16)
    plan.kv_visible[plan.kv_indptr[1] + 5] = False  # item 1 hides a key of the prompt
    plan.custom_masks[2] = torch.ones(1, plan.kv_indptr[3] - plan.kv_indptr[2], dtype=torch.bool)
    kv = random_pool(torch.Generator(), 200, 16, 3, 64, torch.float32)
    flat = kernel_of(48).kernel_args(plan, kv)[7].tolist()
    assert groups_of(flat) == [([0, 3], SYSTEM[:8])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, page_size, dim", [
    (9, 3, 16, 64), (8, 1, 5, 64), (16, 2, 8, 128), (16, 2, 16, 128), (5, 1, 16, 96)])
def test_shared_prefix_attention_equals_the_reference(dtype, heads, kv_heads, page_size, dim):
    g = torch.Generator().manual_seed(heads + page_size)
    kv = random_pool(g, 200, page_size, kv_heads, dim, dtype)
    plan = plan_of(ITEMS, page_size)
    plan.kv_visible[plan.kv_indptr[7] - 2] = False  # a hidden key in item 6's own page
    # Scale queries so that some scores are large: the merge must rescale both parts.
    q = (torch.randn(plan.q_indptr[-1], heads, dim, generator=g) * 4).to(dtype)
    kernel = kernel_of(2 * page_size)
    got = kernel.run(q, kv, 0, plan)
    assert kernel.groups[0] == 2
    expected = TorchPagedAttention().run(q, kv, 0, plan)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
