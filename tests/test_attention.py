"""The C++ CPU kernel against the pure-PyTorch reference, on random paged plans."""

from __future__ import annotations

import pytest
import torch

from pie.backend.attention import AttentionPlan, CpuKernelAttention, TorchPagedAttention


def random_plan(generator: torch.Generator, slots: int, shapes: list[tuple[int, int]],
                custom: list[bool], hidden_fraction: float) -> AttentionPlan:
    """Items of (n_context, n_new) keys over distinct random slots of the pool."""
    q_indptr, kv_indptr, masks = [0], [0], []
    total_keys = sum(c + n for c, n in shapes)
    perm = torch.randperm(slots, generator=generator)[:total_keys]
    visible = torch.rand(total_keys, generator=generator) >= hidden_fraction
    for (n_ctx, n_new), use_custom in zip(shapes, custom):
        start = kv_indptr[-1]
        visible[start + n_ctx : start + n_ctx + n_new] = True  # new tokens are never masked
        q_indptr.append(q_indptr[-1] + n_new)
        kv_indptr.append(start + n_ctx + n_new)
        mask = None
        if use_custom:
            mask = torch.rand(n_new, n_ctx + n_new, generator=generator) > 0.4
            mask[:, n_ctx:] |= torch.eye(n_new, dtype=torch.bool)  # each token sees itself
        masks.append(mask)
    return AttentionPlan(q_indptr, kv_indptr, perm.to(torch.int64), visible, masks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_kernel_matches_reference(dtype, heads, kv_heads):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    slots, dim = 4096, 64
    keys = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    values = torch.randn(slots, kv_heads, dim, generator=g).to(dtype)
    # Decode items, short multi-token items (drafts), custom masks, and one prefill-sized
    # item that the kernel hands to SDPA.
    shapes = [(0, 1), (37, 1), (300, 1), (16, 5), (129, 3), (64, 40), (10, 2)]
    custom = [False, False, False, False, True, False, True]
    plan = random_plan(g, slots, shapes, custom, hidden_fraction=0.2)
    q = torch.randn(plan.q_indptr[-1], heads, dim, generator=g).to(dtype)
    expected = TorchPagedAttention().run(q, keys, values, plan)
    got = CpuKernelAttention().run(q, keys, values, plan)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_hidden_keys_are_ignored():
    """A key hidden by its page mask bit changes nothing, whatever its contents."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(64, 3, 64, generator=g)
    values = torch.randn(64, 3, 64, generator=g)
    plan = AttentionPlan([0, 1], [0, 9], torch.arange(9), torch.ones(9, dtype=torch.bool), [None])
    plan.kv_visible[4] = False
    q = torch.randn(1, 9, 64, generator=g)
    kernel = CpuKernelAttention()
    before = kernel.run(q, keys, values, plan)
    keys[4], values[4] = 1e3, -1e3
    torch.testing.assert_close(kernel.run(q, keys, values, plan), before)
