"""The CUDA path (FlashInfer paged attention, CUDA graphs for decode).

What runs anywhere: the page tables built from attention plans, the KV cache's "nhd"
layout on CPU tensors (write / gather / copy, and the torch reference attending over it),
the choice of FlashInfer path, the graph buckets and their padding, the config checks.
What needs a GPU (skipped here, with the reason): FlashInfer against the torch reference on
random pools, and greedy tokens with CUDA graphs equal to those without.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from conftest import hf_greedy, run_sampling_passes, sampling_pass
from test_attention import random_plan

from pie.backend.attention import AttentionPlan, TorchPagedAttention
from pie.backend.cuda_graphs import DecodeGraphs
from pie.backend.flashinfer_attention import FlashInferAttention
from pie.backend.kv_cache import KvCache
from pie.backend.paged_index import PagedIndex
from pie.config import BackendConfig, ConfigError, load_config

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; none on this machine (benchmarks/cuda_check.sh runs it on one)",
)
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None,
    reason="needs a CUDA GPU and flashinfer; none on this machine",
)


def plan_of(items: list[list[int]], n_new: list[int] | None = None, hidden: set[int] = frozenset(),
            masks: list[torch.Tensor | None] | None = None) -> AttentionPlan:
    """A plan whose item b reads slots `items[b]`, the last `n_new[b]` of them new (default 1)."""
    n_new = n_new or [1] * len(items)
    q_indptr, kv_indptr = [0], [0]
    for slots, n in zip(items, n_new):
        q_indptr.append(q_indptr[-1] + n)
        kv_indptr.append(kv_indptr[-1] + len(slots))
    flat = torch.tensor([s for slots in items for s in slots])
    visible = torch.tensor([i not in hidden for i in range(len(flat))])
    return AttentionPlan(q_indptr, kv_indptr, flat, visible, masks or [None] * len(items))


def expand(index: PagedIndex, page_size: int) -> list[list[int]]:
    """The slots a page table names, item by item (what FlashInfer reads)."""
    items = []
    for b in range(len(index.last_page_len)):
        pages = index.indices[index.indptr[b] : index.indptr[b + 1]].tolist()
        slots = [p * page_size + o for p in pages for o in range(page_size)]
        items.append(slots[: (len(pages) - 1) * page_size + int(index.last_page_len[b])])
    return items


# --- page tables -----------------------------------------------------------------------------

def test_page_table_of_the_append_pattern():
    ps = 4
    items = [
        [20, 21, 22, 23, 8, 9, 10, 11],  # a full page 5, page 2 filled by the new token
        [28, 29, 30],  # a prompt of three on a fresh page 7
        [4, 5, 6, 7, 36],  # full page 1, the new token opens page 9
    ]
    index = PagedIndex.from_plan(plan_of(items, [1, 3, 1]), ps)
    assert index is not None
    assert index.indptr.tolist() == [0, 2, 3, 5]
    assert index.indices.tolist() == [5, 2, 7, 1, 9]
    assert index.last_page_len.tolist() == [4, 3, 1]
    assert index.indptr.dtype == index.indices.dtype == index.last_page_len.dtype == torch.int32
    assert expand(index, ps) == items


@pytest.mark.parametrize("slots", [
    [8, 9, 36],  # a partial context page, the new token on another page
    [13],  # a scratch slot in mid-page (an item without output pages)
    [0, 1, 6, 7],  # offsets right, but the chunk spans pages 0 and 1
    [1, 0],  # a page's slots out of order
    [0, 1, 2, 3, 4, 5, 6, 7, 9],  # the last chunk starts at offset 1
])
def test_slot_lists_that_are_not_page_tables(slots):
    assert PagedIndex.from_plan(plan_of([slots]), 4) is None
    # one such item spoils the batch: it takes the ragged path as a whole
    assert PagedIndex.from_plan(plan_of([[0, 1, 2], slots]), 4) is None


def shared_prefix_plan(ps: int) -> AttentionPlan:
    """Decode items: 0-3 begin with pages 10-15 (item 3 with 10-12 only), 4-5 with 30-31,
    6 alone; each then has pages of its own, the new token on the last."""
    def item(pages: list[int], extra: int) -> list[int]:
        return [p * ps + o for p in pages for o in range(ps)] + [(40 + extra) * ps + o for o in range(3)]
    shared = list(range(10, 16))
    return plan_of([item(shared, 0), item(shared + [20], 1), item(shared, 2), item(shared[:3] + [21], 3),
                    item([30, 31], 4), item([30, 31, 22], 5), item([32, 33, 34], 6)])


def test_page_table_groups_of_shared_prefixes():
    index = PagedIndex.from_plan(shared_prefix_plan(4), 4)
    assert index is not None
    assert sorted(index.shared_prefixes(2, 2)) == [([0, 1, 2, 3], 3), ([4, 5], 2)]
    assert index.shared_prefixes(4, 2) == []  # items 0-3 share 3 pages; 4-5 only 2
    assert index.shared_prefixes(2, 3) == [([0, 1, 2, 3], 3)]
    rest = index.without_prefixes(index.shared_prefixes(2, 2))
    assert expand(rest, 4)[0] == expand(index, 4)[0][12:]  # pages 13-15 and its own are left
    assert expand(rest, 4)[1] == expand(index, 4)[1][12:]
    assert expand(rest, 4)[6] == expand(index, 4)[6]  # not grouped: unchanged


@pytest.mark.parametrize("page_size", [16, 5])
def test_page_table_names_exactly_the_plan_slots(page_size):
    """Random plans laid out as the engine lays them out (test_attention.random_plan)."""
    g = torch.Generator().manual_seed(page_size)
    shapes = [(0, 1), (37, 1), (300, 1), (16, 5), (129, 3), (64, 40), (10, 2)]
    plan = random_plan(g, 200, page_size, shapes, [False] * len(shapes), 0.0)
    index = PagedIndex.from_plan(plan, page_size)
    assert index is not None
    want = [plan.kv_slots[plan.kv_indptr[b] : plan.kv_indptr[b + 1]].tolist()
            for b in range(plan.num_items)]
    assert expand(index, page_size) == want


def test_padding_appends_one_key_items_on_the_pad_page():
    index = PagedIndex.from_plan(plan_of([[20, 21, 22, 23, 8], [28]]), 4)
    padded = index.padded(5, pad_page=99)
    assert padded.indptr.tolist() == [0, 2, 3, 4, 5, 6]
    assert padded.indices.tolist() == [5, 2, 7, 99, 99, 99]
    assert padded.last_page_len.tolist() == [1, 1, 1, 1, 1]
    assert index.padded(2, 99).indices.tolist() == index.indices.tolist()
    with pytest.raises(ValueError, match="cannot pad"):
        index.padded(1, 99)


def test_flashinfer_path_choice():
    page = [0, 1, 2, 3, 4]  # a page table (ps 4)
    assert FlashInferAttention.choose(plan_of([page, [8]]), 4)[0] == "decode"
    assert FlashInferAttention.choose(plan_of([page, [8]], [2, 1]), 4)[0] == "prefill"
    assert FlashInferAttention.choose(plan_of([page, [8]], hidden={1}), 4)[0] == "prefill"
    custom = [None, torch.ones(1, 1, dtype=torch.bool)]
    assert FlashInferAttention.choose(plan_of([page, [8]], masks=custom), 4)[0] == "prefill"
    path, index = FlashInferAttention.choose(plan_of([page, [13]]), 4)
    assert (path, index) == ("ragged", None)


# --- the "nhd" KV layout on CPU tensors ------------------------------------------------------

def twin_caches(page_size: int, dtype: torch.dtype = torch.float32) -> tuple[KvCache, KvCache]:
    args = (2, 12, page_size, 2 * page_size + 3, 3, 64, dtype, CPU)
    return KvCache(*args), KvCache(*args, layout="nhd")


@pytest.mark.parametrize("page_size", [16, 5])
def test_nhd_layout_write_gather_copy_equal_the_cpu_layout(page_size):
    g = torch.Generator().manual_seed(page_size)
    cpu, nhd = twin_caches(page_size)
    assert (cpu.layout, nhd.layout) == ("cpu", "nhd") and nhd.kernel is None
    # nhd: [pages, page_size, kv_heads, head_dim], plus the padding page after the scratch
    assert nhd.keys[0].shape == nhd.values[0].shape == (12 + 3 + 1, page_size, 3, 64)
    assert nhd.pad_page == 15 and cpu.pad_page is None and cpu.keys[0].shape[0] == 15
    slots = torch.randperm(15 * page_size, generator=g)[:40]
    for layer in range(2):
        k, v = torch.randn(40, 3, 64, generator=g), torch.randn(40, 3, 64, generator=g)
        for kv in (cpu, nhd):
            kv.write(layer, slots, k, v)
        keys, values = nhd.gather(layer, slots)
        assert torch.equal(keys, k) and torch.equal(values, v)
        everything = torch.arange(15 * page_size)
        for a, b in zip(cpu.gather(layer, everything), nhd.gather(layer, everything)):
            assert torch.equal(a, b)
    # in nhd, slot s is row s of the pool: page s // page_size, offset s % page_size
    s = int(slots[0])
    assert torch.equal(nhd.keys[1][s // page_size, s % page_size], k[0])
    dst = torch.arange(10) + 3 * page_size
    src = slots[(slots < 3 * page_size) | (slots >= 3 * page_size + 10)][:10]  # apart from dst
    nhd.masked[src[:3]] = True
    cpu.masked[src[:3]] = True
    for kv in (cpu, nhd):
        kv.copy_slots(src, dst)
    for layer in range(2):
        for copied, original in zip(nhd.gather(layer, dst), nhd.gather(layer, src)):
            assert torch.equal(copied, original)
        for a, b in zip(cpu.gather(layer, torch.arange(15 * page_size)),
                        nhd.gather(layer, torch.arange(15 * page_size))):
            assert torch.equal(a, b)
    assert nhd.masked[dst[:3]].all() and torch.equal(cpu.masked, nhd.masked[: len(cpu.masked)])


def test_bad_layout_is_refused():
    with pytest.raises(ValueError, match="layout"):
        KvCache(1, 4, 16, 0, 3, 64, torch.float32, CPU, layout="hnd")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_attention_reads_the_nhd_layout(dtype):
    """TorchPagedAttention (the reference on CUDA) gives the same output over either layout."""
    g = torch.Generator().manual_seed(7)
    pages, ps = 60, 16
    cpu, nhd = (KvCache(1, pages, ps, 0, 3, 64, dtype, CPU, layout=lay) for lay in ("cpu", "nhd"))
    slots = torch.arange(pages * ps)
    k, v = torch.randn(len(slots), 3, 64, generator=g), torch.randn(len(slots), 3, 64, generator=g)
    for kv in (cpu, nhd):
        kv.write(0, slots, k, v)
    shapes = [(0, 1), (37, 1), (100, 1), (16, 5), (40, 3), (30, 40)]
    plan = random_plan(g, pages, ps, shapes, [False, False, False, False, True, False], 0.2)
    q = torch.randn(plan.q_indptr[-1], 9, 64, generator=g).to(dtype)
    reference = TorchPagedAttention()
    assert torch.equal(reference.run(q, cpu, 0, plan), reference.run(q, nhd, 0, plan))


# --- CUDA graph buckets, config ------------------------------------------------------------

def test_graph_buckets_and_padding():
    assert DecodeGraphs.buckets(4096) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert DecodeGraphs.buckets(100) == [1, 2, 4, 8, 16, 32, 64]
    assert DecodeGraphs.buckets(1) == [1]
    sizes = DecodeGraphs.buckets(4096)
    assert [DecodeGraphs.bucket_for(n, sizes) for n in (1, 2, 3, 5, 64, 65, 256)] == \
        [1, 2, 4, 8, 64, 128, 256]
    assert DecodeGraphs.bucket_for(257, sizes) is None  # runs eagerly


def test_cuda_graphs_need_cuda_and_flashinfer(tmp_path):
    with pytest.raises(ConfigError, match='needs backend.device = "cuda".*got device \'cpu\''):
        BackendConfig(cuda_graphs=True)
    with pytest.raises(ConfigError, match="attention 'auto'"):
        BackendConfig(device="cuda", cuda_graphs=True)
    assert BackendConfig(device="cuda", attention="flashinfer", cuda_graphs=True).cuda_graphs
    path = tmp_path / "pie.toml"
    path.write_text("[backend]\ncuda_graphs = true\n")
    with pytest.raises(ConfigError, match="cuda_graphs"):
        load_config(path)


def test_auto_attention_is_flashinfer_on_cuda_where_it_is_installed(monkeypatch):
    from pie.backend.engine import Engine

    choose, cuda = Engine.attention_choice, torch.device("cuda")
    assert choose("auto", CPU, torch.bfloat16) == "cpu-kernel"
    assert choose("torch", CPU, torch.bfloat16) == "torch"
    assert choose("torch", cuda, torch.bfloat16) == "torch"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object() if name == "flashinfer" else None)
    assert choose("auto", cuda, torch.bfloat16) == "flashinfer"
    assert choose("auto", cuda, torch.float16) == "flashinfer"
    assert choose("auto", cuda, torch.float32) == "torch"  # FlashInfer has no fp32 kernels
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert choose("auto", cuda, torch.bfloat16) == "torch"


# --- on a GPU ------------------------------------------------------------------------------

def cuda_pool(g: torch.Generator, pages: int, ps: int) -> KvCache:
    kv = KvCache(1, pages, ps, 128, 2, 64, torch.bfloat16, torch.device("cuda"))
    slots = torch.arange(pages * ps, device="cuda")
    kv.write(0, slots, torch.randn(len(slots), 2, 64, generator=g).cuda(),
             torch.randn(len(slots), 2, 64, generator=g).cuda())
    return kv


@needs_gpu
@pytest.mark.parametrize("case, path", [
    ("decode", "decode"), ("prefill", "prefill"), ("masks", "prefill"), ("scratch", "ragged")])
def test_flashinfer_matches_the_reference(case, path):
    g = torch.Generator().manual_seed(11)
    ps, pages = 16, 120
    kv = cuda_pool(g, pages, ps)
    assert kv.layout == "nhd"
    if case == "decode":
        shapes, custom, hidden = [(0, 1), (15, 1), (16, 1), (300, 1), (47, 1)], [False] * 5, 0.0
    else:
        shapes, custom = [(0, 1), (37, 1), (16, 5), (129, 3), (64, 40), (0, 70)], [False] * 6
        hidden = 0.0
        if case == "masks":
            custom, hidden = [False, False, False, True, True, False], 0.2
    plan = random_plan(g, pages, ps, shapes, custom, hidden)
    if case == "scratch":  # the last item's new tokens on scratch slots, as without output pages
        n_new = shapes[-1][1]
        plan.kv_slots[-n_new:] = torch.arange(kv.scratch_start + 1, kv.scratch_start + 1 + n_new)
    plan = AttentionPlan(plan.q_indptr, plan.kv_indptr, plan.kv_slots.cuda(),
                         plan.kv_visible.cuda(),
                         [m if m is None else m.cuda() for m in plan.custom_masks])
    q = torch.randn(plan.q_indptr[-1], 8, 64, generator=g).to(torch.bfloat16).cuda()
    attention = FlashInferAttention(8, 2, 64, torch.bfloat16, torch.device("cuda"))
    got = attention.run(q, kv, 0, plan)
    assert attention.path == path
    torch.testing.assert_close(got, TorchPagedAttention().run(q, kv, 0, plan), rtol=2e-2, atol=2e-2)


@needs_gpu
def test_flashinfer_cascade_over_shared_prefixes_matches_the_reference():
    """Decode items grouped by their shared pages (a cascade: prefix pass, decode pass,
    merged) give what the reference gives attending to each item's keys one by one."""
    g = torch.Generator().manual_seed(5)
    kv = cuda_pool(g, 60, 16)
    plan = shared_prefix_plan(16)
    plan = AttentionPlan(plan.q_indptr, plan.kv_indptr, plan.kv_slots.cuda(), plan.kv_visible.cuda(),
                         plan.custom_masks)
    q = (torch.randn(plan.q_indptr[-1], 8, 64, generator=g) * 3).to(torch.bfloat16).cuda()
    attention = FlashInferAttention(8, 2, 64, torch.bfloat16, torch.device("cuda"), shared_prefix_keys=32)
    attention.SHARED_PREFIX_MIN_READ = 1  # these groups are far smaller than where it pays
    got = attention.run(q, kv, 0, plan)
    assert attention.path == "decode" and attention.members is not None
    assert sorted(attention.members.tolist()) == [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(got, TorchPagedAttention().run(q, kv, 0, plan), rtol=2e-2, atol=2e-2)


def greedy(engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of each prompt through fused passes: one prefill batch, then `steps`
    decode batches of every sequence (each on its own 8 pages)."""
    ps = engine.page_size
    pages = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]
    out = [[t] for t in run_sampling_passes(engine, [sampling_pass(p, 0, pages[i], ps) for i, p in enumerate(prompts)])]
    for _ in range(steps):
        lengths = [len(p) + len(o) - 1 for p, o in zip(prompts, out)]
        step = run_sampling_passes(engine, [sampling_pass([o[-1]], n, pg, ps) for o, n, pg in zip(out, lengths, pages)])
        for o, t in zip(out, step):
            o.append(t)
    return out


@needs_cuda
def test_fp32_greedy_on_cuda_equals_hf(model_dir, hf_model):
    """The oracle on the GPU: fp32 with the torch attention, HF's greedy tokens exactly."""
    from pie.backend.engine import Engine

    engine = Engine(model_dir, BackendConfig(device="cuda", dtype="float32", attention="torch",
                                             num_kv_pages=64, num_embeds=64))
    prompts = [[1, 504, 3575, 282, 4649, 314], [1, 2, 3] * 7, [42] * 17]
    assert greedy(engine, prompts, 15) == [hf_greedy(hf_model, p, 16) for p in prompts]


@needs_gpu
def test_cuda_graphs_give_the_tokens_of_eager_decode(model_dir, monkeypatch):
    """Three sequences (padded to the bucket of 4), then with buckets capped at 2 (every
    step runs eagerly: the documented fallback, not a crash)."""
    from pie.backend.engine import Engine

    prompts = [[504, 3575, 282, 4649, 314], [1, 2, 3] * 7, [42] * 17]
    config = dict(device="cuda", dtype="bfloat16", attention="flashinfer", num_kv_pages=64,
                  num_embeds=64, max_batch_tokens=128)
    want = greedy(Engine(model_dir, BackendConfig(**config)), prompts, 24)
    engine = Engine(model_dir, BackendConfig(**config, cuda_graphs=True))
    replays = []
    forward = engine.graphs.forward

    def spy(*args):
        hidden = forward(*args)
        replays.append(hidden is not None)
        return hidden

    monkeypatch.setattr(engine.graphs, "forward", spy)
    assert greedy(engine, prompts, 24) == want
    assert replays.count(True) == 24
    monkeypatch.setattr(DecodeGraphs, "MAX_BUCKET", 2)
    capped = Engine(model_dir, BackendConfig(**config, cuda_graphs=True))
    assert capped.graphs.sizes == [1, 2]
    assert greedy(capped, prompts, 24) == want


def scored(engine) -> tuple[np.ndarray, list[int]]:
    """A 520-token prefix written to pages, then a 540-token pass over it that keeps no KV:
    (log-probabilities of three tokens at its last position, top-4 ids there)."""
    from pie.control.passes import Output, Pass, encode

    prefix = [(7 * i + 300) % 49_000 for i in range(520)]
    post = [(11 * i + 77) % 49_000 for i in range(540)]
    pages = list(range(33))
    fill = Pass(None, 0, 16, prefix, list(range(520)), [], [], 0, pages, 0, None, [Output(519)])  # type: ignore[arg-type]
    score = Pass(None, 1, 16, post, list(range(520, 1060)), [], pages, 8, [], 0, None,  # type: ignore[arg-type]
                 [Output(539, logprob_ids=[5, 42, 1000], dist_k=4)])
    replies = [engine.handle(encode([p])) for p in (fill, score)]
    assert all(reply.errors == {} for reply in replies)
    return (np.frombuffer(replies[1].logprobs, np.float32),
            np.frombuffer(replies[1].dist_ids, np.int32).tolist())


@pytest.mark.parametrize("dtype, attention", [
    pytest.param("float32", "torch", marks=needs_cuda), pytest.param("bfloat16", "flashinfer", marks=needs_gpu)])
def test_chunked_items_on_cuda_give_the_one_shot_results(model_dir, dtype, attention):
    """`backend.mlp_chunk_tokens` on the GPU (chunked_forward.py's SDPA beside the engine's
    attention, the cache in the "nhd" layout): a long no-KV pass scores as in one shot."""
    from pie.backend.engine import Engine

    results = [scored(Engine(model_dir, BackendConfig(
        device="cuda", dtype=dtype, attention=attention, num_kv_pages=40, num_embeds=8,
        mlp_chunk_tokens=chunk))) for chunk in (0, 256)]
    (one_shot, top0), (chunked, top1) = results
    assert top1[0] == top0[0]
    assert chunked == pytest.approx(one_shot, abs=1e-3 if dtype == "float32" else 5e-2, rel=0)
