"""The C++ CPU kernel against the pure-PyTorch reference, on random paged plans."""

from __future__ import annotations

import pytest
import torch

from pie.backend.attention import AttentionPlan, CpuKernelAttention, TorchPagedAttention
from pie.backend.dtype import cpu_flags
from pie.backend.kv_cache import KvCache


def random_pool(generator: torch.Generator, pages: int, page_size: int, kv_heads: int,
                dim: int, dtype: torch.dtype) -> KvCache:
    kv = KvCache(1, pages, page_size, 0, kv_heads, dim, dtype, torch.device("cpu"))
    slots = torch.arange(pages * page_size)
    kv.write(0, slots, torch.randn(len(slots), kv_heads, dim, generator=generator),
             torch.randn(len(slots), kv_heads, dim, generator=generator))
    return kv


def random_plan(generator: torch.Generator, pages: int, page_size: int,
                shapes: list[tuple[int, int]], custom: list[bool],
                hidden_fraction: float) -> AttentionPlan:
    """Items of (n_context, n_new) keys on random pages, laid out as the engine lays them out.

    Page size 5 has no vectorised path, so it exercises the kernel's scalar path throughout.
    """
    q_indptr, kv_indptr, masks = [0], [0], []
    page_order = torch.randperm(pages, generator=generator).tolist()
    slot_lists: list[int] = []
    for n_ctx, n_new in shapes:
        # New tokens continue the context's last page (the append pattern), then fresh pages.
        n_pages = -(-(n_ctx + n_new) // page_size)
        own = [page_order.pop() for _ in range(n_pages)]
        slot_lists += [p * page_size + o for p in own for o in range(page_size)][: n_ctx + n_new]
    slots = torch.tensor(slot_lists)
    visible = torch.rand(len(slots), generator=generator) >= hidden_fraction
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
    return AttentionPlan(q_indptr, kv_indptr, slots, visible, masks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, page_size, dim", [
    (9, 3, 16, 64), (4, 4, 8, 64), (8, 1, 5, 64),  # SmolLM2's group and head size; scalar pages
    (16, 2, 16, 128), (12, 2, 32, 64), (5, 1, 16, 96)])  # 8 heads a group (two blocks of 4), odd sizes
def test_kernel_matches_reference(dtype, heads, kv_heads, page_size, dim):
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    pages = 200
    kv = random_pool(g, pages, page_size, kv_heads, dim, dtype)
    # Decode items, short multi-token items (drafts), custom masks, and one prefill-sized
    # item that the kernel hands to SDPA.
    shapes = [(0, 1), (37, 1), (300, 1), (16, 5), (129, 3), (64, 40), (10, 2)]
    custom = [False, False, False, False, True, False, True]
    plan = random_plan(g, pages, page_size, shapes, custom, hidden_fraction=0.2)
    q = torch.randn(plan.q_indptr[-1], heads, dim, generator=g).to(dtype)
    expected = TorchPagedAttention().run(q, kv, 0, plan)
    got = CpuKernelAttention().run(q, kv, 0, plan)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_prompts_take_the_kernel_within_its_pairs_and_match_the_reference(dtype):
    """Past PREFILL_TOKENS new tokens an item takes the kernel while its query-key pairs
    (new tokens x average visible keys) stay within `kernel_pairs` (by default on CPUs
    without AVX-512 BF16, where SDPA's fixed cost per item loses on short prompts), SDPA
    beyond: the same output either way."""
    g = torch.Generator().manual_seed(11)
    kv = random_pool(g, 120, 16, 3, 64, dtype)
    # A 100-token prompt from its start (5,000 pairs), a 60-token chunk after 200 cached keys
    # (13,800), a 300-token prompt (45,000).
    plan = random_plan(g, 120, 16, [(0, 100), (200, 60), (0, 300), (40, 1)], [False, False, False, False], 0.0)
    q = torch.randn(plan.q_indptr[-1], 9, 64, generator=g).to(dtype)
    expected = TorchPagedAttention().run(q, kv, 0, plan)
    kernel = CpuKernelAttention(kernel_pairs=20_000)
    got = kernel.run(q, kv, 0, plan)
    assert kernel.prefill_items == [2]
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    plain = CpuKernelAttention(kernel_pairs=0)
    plain.run(q, kv, 0, plan)
    assert plain.prefill_items == [0, 1, 2]
    assert CpuKernelAttention().kernel_pairs == CpuKernelAttention.default_kernel_pairs(cpu_flags())
    rule = CpuKernelAttention.default_kernel_pairs
    assert rule({"avx2", "fma"}) == CpuKernelAttention.AVX2_KERNEL_PAIRS
    assert rule({"avx2", "avx512f"}) == CpuKernelAttention.AVX512_KERNEL_PAIRS
    assert rule({"avx2", "avx512f", "avx512_bf16"}) == rule(set()) == 0


def test_hidden_keys_are_ignored():
    """A key hidden by its page mask bit changes nothing, whatever its contents."""
    g = torch.Generator().manual_seed(3)
    kv = random_pool(g, 4, 16, 3, 64, torch.float32)
    plan = AttentionPlan([0, 1], [0, 20], torch.arange(20), torch.ones(20, dtype=torch.bool), [None])
    plan.kv_visible[4] = False
    q = torch.randn(1, 9, 64, generator=g)
    kernel = CpuKernelAttention()
    before = kernel.run(q, kv, 0, plan)
    kv.write(0, torch.tensor([4]), torch.full((1, 3, 64), 1e3), torch.full((1, 3, 64), -1e3))
    torch.testing.assert_close(kernel.run(q, kv, 0, plan), before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [16, 5])
def test_kernel_kv_write_equals_index_assignment(dtype, page_size):
    """The C++ writer puts every key and value where torch's index assignment puts them."""
    generator = torch.Generator().manual_seed(3)
    kernel_side = KvCache(1, 12, page_size, 0, 3, 64, dtype, torch.device("cpu"))
    torch_side = KvCache(1, 12, page_size, 0, 3, 64, dtype, torch.device("cpu"))
    torch_side.kernel = None  # index assignment, the path without the kernel
    slots = torch.randperm(12 * page_size, generator=generator)[:37]
    k, v = torch.randn(37, 3, 64, generator=generator), torch.randn(37, 3, 64, generator=generator)
    for kv in (kernel_side, torch_side):
        kv.write(0, slots, k, v)
    assert kernel_side.kernel is not None
    assert torch.equal(kernel_side.keys[0], torch_side.keys[0])
    assert torch.equal(kernel_side.values[0], torch_side.values[0])
    with pytest.raises(RuntimeError, match="out of range"):
        kernel_side.write(0, torch.tensor([12 * page_size]), k[:1], v[:1])


def test_a_stale_build_lock_is_removed(tmp_path):
    """A kernel build killed mid-way leaves torch's `lock` file in its build directory, and
    every later start would wait on it forever: one older than STALE_LOCK_S is removed; a
    fresh one (a build in progress in another process) is not."""
    import os
    import time

    from pie.backend.kernels import STALE_LOCK_S, clear_stale_lock

    lock = tmp_path / "lock"
    assert not clear_stale_lock(lock)
    lock.touch()
    assert not clear_stale_lock(lock) and lock.exists()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert clear_stale_lock(lock) and not lock.exists()


def test_kernels_compile_from_a_copy_in_their_cache_folder():
    """torch writes the compiled source's absolute path into build.ninja: compiling csrc/ in
    place rebuilt every kernel whenever the same commit ran from another checkout (a git
    worktree, CI's clone). The build compiles a copy kept beside its objects instead, so
    build.ninja names no checkout."""
    from pathlib import Path

    from pie.backend.kernels import CSRC, paged_attention_module

    build_dir = Path(paged_attention_module().__file__).parent
    ninja = (build_dir / "build.ninja").read_text()
    assert str(CSRC) not in ninja and str(build_dir / "paged_attention.cpp") in ninja
    for name in ("paged_attention.cpp", "fast_exp.h", "shared_prefix.h"):
        assert (build_dir / name).read_bytes() == (CSRC / name).read_bytes()


def test_a_prompt_from_its_start_takes_sdpa_causal_rule_with_the_same_result(monkeypatch):
    """Items with no context, no custom mask and no hidden key run SDPA with `is_causal`
    (no dense mask): the output equals the masked path's bit for bit; any other item keeps
    the mask."""
    g = torch.Generator().manual_seed(5)
    kv = random_pool(g, 40, 16, 3, 64, torch.float32)
    plan = random_plan(g, 40, 16, [(0, 70), (30, 40), (0, 50), (0, 45)], [False, False, True, False], 0.0)
    plan.kv_visible[plan.kv_indptr[3] + 2] = False  # a hidden key in the last item
    assert [plan.starts_causal(b) for b in range(4)] == [True, False, False, False]
    q = torch.randn(plan.q_indptr[-1], 9, 64, generator=g)
    reference = TorchPagedAttention()
    fast = reference.run(q, kv, 0, plan)
    monkeypatch.setattr(AttentionPlan, "starts_causal", lambda self, b: False)
    assert torch.equal(fast, reference.run(q, kv, 0, plan))


@pytest.mark.parametrize("heads, kv_heads, page_size, dim", [
    (9, 3, 16, 64), (4, 4, 8, 64), (8, 1, 5, 64), (16, 2, 16, 128), (12, 2, 32, 64)])
def test_bf16_prompts_take_the_flash_kernel_and_match_the_reference(heads, kv_heads, page_size, dim):
    """In bf16 with AVX-512 BF16 (csrc/prompt_attention.h), prefill items that see every key
    causally — from their start or after cached context, on scattered pages, lengths that
    leave partial pages and partial blocks of 24 query rows — take the flash kernel and
    match the fp32 reference within bf16 rounding (its probabilities are bf16); one with a
    custom mask and one with a hidden key keep SDPA."""
    g = torch.Generator().manual_seed(heads * 7 + dim)
    pages = 160
    kv = random_pool(g, pages, page_size, kv_heads, dim, torch.bfloat16)
    shapes = [(0, 300), (37, 100), (16, 33), (0, 45), (20, 50), (3, 1)]
    plan = random_plan(g, pages, page_size, shapes, [False, False, False, False, True, False], 0.0)
    plan.kv_visible[plan.kv_indptr[3] + 2] = False  # a hidden key: item 3 keeps SDPA
    q = torch.randn(plan.q_indptr[-1], heads, dim, generator=g).to(torch.bfloat16)
    expected = TorchPagedAttention().run(q, kv, 0, plan)
    kernel = CpuKernelAttention(kernel_pairs=0)  # short prompts too go the prefill route
    got = kernel.run(q, kv, 0, plan)
    assert kernel.prefill_items == [0, 1, 2, 3, 4]
    has_kernel = kernel.kernel.prompt_attention_supports(heads, kv_heads, dim)
    assert has_kernel == ("avx512_bf16" in cpu_flags() and "avx512f" in cpu_flags())
    assert kernel.prompt_items == (3 if has_kernel else 0)
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)


def test_the_flash_kernel_refuses_what_it_cannot_do():
    module = CpuKernelAttention().kernel
    if not module.prompt_attention_supports(9, 3, 64):
        pytest.skip("this CPU has no AVX-512 BF16: prompts keep SDPA")
    assert not module.prompt_attention_supports(5, 1, 64)  # a group of 5 does not divide 24 rows
    assert not module.prompt_attention_supports(9, 3, 96)
    kv = random_pool(torch.Generator().manual_seed(1), 4, 16, 3, 64, torch.bfloat16)
    q = torch.randn(10, 9, 64).to(torch.bfloat16)
    slots = torch.arange(12)
    with pytest.raises(RuntimeError, match="n_context \\+ new tokens must be the keys"):
        module.prompt_attention(q, kv.keys[0], kv.values[0], slots, 0, 0.125)
    with pytest.raises(RuntimeError, match="KV slot out of range"):
        module.prompt_attention(q, kv.keys[0], kv.values[0], torch.arange(10) + 60, 0, 0.125)
    with pytest.raises(RuntimeError, match="q must be contiguous bf16"):
        module.prompt_attention(q.float(), kv.keys[0], kv.values[0], torch.arange(10), 0, 0.125)


def test_the_flash_kernel_gives_a_row_the_same_bits_whatever_rows_are_beside_it():
    """chunked_forward.py calls the kernel 64 queries at a time over one item's fp32 copies of
    its keys (`prompt_attention_dense`); the one-shot forward calls it once over the pools:
    the same bits, since a row's sums do not depend on the other rows of its call."""
    module = CpuKernelAttention().kernel
    if not module.prompt_attention_supports(9, 3, 64):
        pytest.skip("this CPU has no AVX-512 BF16: prompts keep SDPA")
    g = torch.Generator().manual_seed(9)
    n_ctx, n_new = 70, 200
    kv = random_pool(g, 40, 16, 3, 64, torch.bfloat16)
    slots = torch.randperm(40 * 16, generator=g)[: n_ctx + n_new]
    q = torch.randn(n_new, 9, 64, generator=g).to(torch.bfloat16)
    whole = module.prompt_attention(q, kv.keys[0], kv.values[0], slots, n_ctx, 0.125)
    keys, values = kv.gather(0, slots)
    keys, values = keys.float().transpose(0, 1).contiguous(), values.float().transpose(0, 1).contiguous()
    chunks = torch.cat([module.prompt_attention_dense(q[c:c + 64].contiguous(), keys, values, n_ctx + c, 0.125)
                        for c in range(0, n_new, 64)])
    assert torch.equal(chunks, whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_items_beside_a_prompt_give_the_bits_they_give_alone(dtype):
    """Beside prefill items the kernel runs over its own items' query rows only (the
    prompts' rows are neither converted nor zeroed): the decode items' outputs are the bits
    they get in a batch without the prompt, and the prompt's rows its own result's."""
    g = torch.Generator().manual_seed(21)
    kv = random_pool(g, 120, 16, 3, 64, dtype)
    shapes, custom = [(37, 1), (0, 120), (90, 3), (300, 1)], [False, False, True, False]
    plan = random_plan(g, 120, 16, shapes, custom, 0.1)
    q = torch.randn(plan.q_indptr[-1], 9, 64, generator=g).to(dtype)
    attention = CpuKernelAttention(kernel_pairs=0)
    got = attention.run(q, kv, 0, plan)
    assert attention.prefill_items == [1] and len(attention.kernel_rows[0]) == 5
    alone = [b for b in range(len(shapes)) if b != 1]
    rows = torch.cat([torch.arange(plan.q_indptr[b], plan.q_indptr[b + 1]) for b in alone])
    keys = [torch.arange(plan.kv_indptr[b], plan.kv_indptr[b + 1]) for b in alone]
    q_indptr, kv_indptr = [0], [0]
    for b, k in zip(alone, keys):
        q_indptr.append(q_indptr[-1] + plan.q_indptr[b + 1] - plan.q_indptr[b])
        kv_indptr.append(kv_indptr[-1] + len(k))
    keys = torch.cat(keys)
    without = AttentionPlan(q_indptr, kv_indptr, plan.kv_slots[keys], plan.kv_visible[keys],
                            [plan.custom_masks[b] for b in alone])
    assert torch.equal(got[rows], CpuKernelAttention(kernel_pairs=0).run(q[rows], kv, 0, without))
    prompt = slice(plan.q_indptr[1], plan.q_indptr[2])
    expected = TorchPagedAttention().run(q, kv, 0, plan)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[prompt], expected[prompt], rtol=tolerance, atol=tolerance)
