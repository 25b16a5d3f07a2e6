// Shared-prefix decode attention (Parrot's and Hydragen's idea; issue 19): decode items whose
// context begins with the same KV pages attend to that prefix together, as two batched
// matrix products over one fp32 copy of the prefix per layer, instead of each item streaming
// the prefix's keys and values through its own score and value loops. paged_attention.cpp
// then runs each item's own keys (its suffix) as before and merges the two softmax parts.
// Why: 32 decoders on a 2,048-key system prompt spent 2.35 ms per layer in attention on the
// Xeon of 2026-11-27 (bf16 pools, 2 vCPUs); the prefix as a GEMM reads it once and runs at
// the BLAS's rate (on AVX2 CPUs our own loop's: small_gemm.h) (figures: docs/backend.md,
// benchmarks/results/shared_prompt.json).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "fast_exp.h"
#include "small_gemm.h"

namespace shared_prefix {

// One group's prefix part for every member: scores of member m's query heads of KV head h
// sit in row h * rows + m * group + g of `acc` ([kv_heads, rows, dim], not yet divided by
// `total`), `top` (the row's max score) and `total` (sum of e^(score - top)).
struct Part {
  torch::Tensor acc, top, total;
  int64_t rows = 0;  // members * group: the stride between KV heads
};

// Where an item's prefix part is: `keys` of its context (0: none) and its member row.
struct ItemPart {
  int64_t keys = 0;
  const float* acc = nullptr;
  const float* top = nullptr;
  const float* total = nullptr;
  int64_t rows = 0, row = 0;
};

// Groups of decode items sharing a prefix of whole pages, flattened as
// [n_groups, then per group: n_pages, n_members, members..., pages...].
// A member: one new token, no custom mask, enabled, every prefix key visible. The prefix is
// the longest run of whole pages (slot p * page_size + o at key p' * page_size + o) that all
// members' contexts begin with, and at least `min_keys` keys; items are grouped by their
// first page, and a group has at least `min_members` (below that the copy of the prefix costs
// more than it saves). Computed once per forward (its cost is one pass over the slots).
inline torch::Tensor find_groups(torch::Tensor q_indptr, torch::Tensor kv_indptr, torch::Tensor slots,
                                 torch::Tensor visible, torch::Tensor mask_offsets,
                                 torch::Tensor enabled, int64_t page_size, int64_t min_keys,
                                 int64_t min_members) {
  const int64_t n_items = q_indptr.size(0) - 1;
  const int64_t* qi = q_indptr.data_ptr<int64_t>();
  const int64_t* ki = kv_indptr.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const bool* seen = visible.data_ptr<bool>();
  const int64_t* masks = mask_offsets.data_ptr<int64_t>();
  const bool* on = enabled.data_ptr<bool>();
  // Whole, visible, in-order pages at the start of each candidate's context.
  std::vector<int64_t> whole(n_items, 0);
  std::unordered_map<int64_t, std::vector<int64_t>> by_first_page;
  for (int64_t b = 0; b < n_items; ++b) {
    if (qi[b + 1] - qi[b] != 1 || masks[b] >= 0 || !on[b]) continue;
    const int64_t k0 = ki[b], context = ki[b + 1] - k0 - 1;
    int64_t n = 0;
    while ((n + 1) * page_size <= context) {
      const int64_t first = slot[k0 + n * page_size];
      bool ok = first % page_size == 0;
      for (int64_t o = 0; ok && o < page_size; ++o)
        ok = slot[k0 + n * page_size + o] == first + o && seen[k0 + n * page_size + o];
      if (!ok) break;
      ++n;
    }
    if (n * page_size < min_keys) continue;
    whole[b] = n;
    by_first_page[slot[k0]].push_back(b);
  }
  std::vector<int64_t> flat{0};
  for (auto& [first, members] : by_first_page) {
    if (static_cast<int64_t>(members.size()) < std::max<int64_t>(min_members, 2)) continue;
    const int64_t lead = members[0];
    int64_t n = whole[lead];
    for (const int64_t b : members) {
      int64_t common = 0;
      const int64_t limit = std::min(n, whole[b]);
      while (common < limit && slot[ki[b] + common * page_size] == slot[ki[lead] + common * page_size]) ++common;
      n = common;
    }
    if (n * page_size < min_keys) continue;
    flat[0] += 1;
    flat.push_back(n);
    flat.push_back(static_cast<int64_t>(members.size()));
    flat.insert(flat.end(), members.begin(), members.end());
    for (int64_t p = 0; p < n; ++p) flat.push_back(slot[ki[lead] + p * page_size] / page_size);
  }
  return torch::tensor(flat, torch::kInt64);
}

// The prefix's keys as fp32 [kv_heads, dim, keys] and values as [kv_heads, keys, dim], read
// from its pages in one pass (index_select, permute and a dtype cast took three).
template <typename T>
void gather_prefix(const T* k_pool, const T* v_pool, const int64_t* pages, int64_t n_pages, int64_t kv_heads,
                   int64_t dim, int64_t page_size, float* k, float* v) {
  const int64_t keys = n_pages * page_size, page_elems = kv_heads * dim * page_size;
  at::parallel_for(0, kv_heads * n_pages, 8, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t h = w / n_pages, p = w % n_pages;
      const T* kp = k_pool + pages[p] * page_elems + h * dim * page_size;  // [dim][page_size]
      const T* vp = v_pool + pages[p] * page_elems + h * page_size * dim;  // [page_size][dim]
      for (int64_t d = 0; d < dim; ++d) {
        float* row = k + (h * dim + d) * keys + p * page_size;
        for (int64_t o = 0; o < page_size; ++o) row[o] = static_cast<float>(kp[d * page_size + o]);
      }
      float* rows = v + (h * keys + p * page_size) * dim;
      for (int64_t i = 0; i < page_size * dim; ++i) rows[i] = static_cast<float>(vp[i]);
    }
  });
}

// Each row of scores [rows, keys] replaced by e^(score - its max), in place; the max and the
// sum of each row. One pass to find the max, one to exponentiate and add (torch took four:
// amax, sub, exp, sum).
inline void softmax_parts(float* scores, int64_t rows, int64_t keys, float* top, float* total) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* s = scores + r * keys;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < keys; ++j) m = s[j] > m ? s[j] : m;  // vectorised (std::max is not)
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < keys; ++j) {
        const float e = exp_nonpositive(s[j] - m);
        s[j] = e;
        sum += e;
      }
      top[r] = m;
      total[r] = sum;
    }
  });
}

// The prefix parts of every group in `groups` (find_groups' layout), and for each item where
// its part is. q: [T, heads, dim] fp32; pools: keys [pages, kv_heads, dim, page_size], values
// [pages, kv_heads, page_size, dim]. Every buffer is carved out of `scratch` (fp32, grown
// here, kept by the caller across calls): fresh megabyte tensors each layer cost more in page
// faults than the gather itself (~1 ms against 0.19 ms for a 2,048-key prefix).
inline std::vector<Part> attend_prefixes(const torch::Tensor& q, const torch::Tensor& k_pool,
                                         const torch::Tensor& v_pool, const int64_t* q_indptr,
                                         const torch::Tensor& groups, torch::Tensor& scratch, double scale,
                                         std::vector<ItemPart>& items) {
  std::vector<Part> parts;
  const int64_t* g = groups.data_ptr<int64_t>();
  const int64_t n_groups = g[0], kv_heads = k_pool.size(1), dim = k_pool.size(2),
                page_size = k_pool.size(3), group = q.size(1) / kv_heads;
  if (n_groups == 0) return parts;
  // Sizes: the prefix copy and scores are reused group after group; the parts are kept.
  int64_t work = 0, kept = 0;
  for (int64_t i = 0, at = 1; i < n_groups; ++i) {
    const int64_t keys = g[at] * page_size, rows = g[at + 1] * group;
    work = std::max(work, kv_heads * keys * (2 * dim + rows));
    kept += kv_heads * rows * (dim + 2);
    at += 2 + g[at + 1] + g[at];
  }
  TORCH_CHECK(scratch.scalar_type() == at::kFloat && scratch.is_contiguous(), "scratch: fp32, contiguous");
  if (scratch.numel() < work + kept) scratch.resize_({work + kept});
  const auto slice = [&](int64_t& offset, at::IntArrayRef shape) {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    auto view = scratch.narrow(0, offset, n).view(shape);
    offset += n;
    return view;
  };
  const auto index = torch::TensorOptions().dtype(torch::kInt64);
  int64_t kept_at = work;
  for (int64_t i = 0, at = 1; i < n_groups; ++i) {
    const int64_t n_pages = g[at], n_members = g[at + 1];
    const int64_t* members = g + at + 2;
    const int64_t* pages = members + n_members;
    at += 2 + n_members + n_pages;
    const int64_t keys = n_pages * page_size, rows = n_members * group;
    int64_t work_at = 0;
    auto k = slice(work_at, {kv_heads, dim, keys}), v = slice(work_at, {kv_heads, keys, dim});
    auto scores = slice(work_at, {kv_heads, rows, keys});
    Part part{slice(kept_at, {kv_heads, rows, dim}), slice(kept_at, {kv_heads, rows}),
              slice(kept_at, {kv_heads, rows}), rows};
    if (k_pool.scalar_type() == at::kBFloat16)
      gather_prefix(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(), pages, n_pages, kv_heads,
                    dim, page_size, k.data_ptr<float>(), v.data_ptr<float>());
    else
      gather_prefix(k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), pages, n_pages, kv_heads, dim,
                    page_size, k.data_ptr<float>(), v.data_ptr<float>());
    std::vector<int64_t> q_rows(n_members);
    for (int64_t m = 0; m < n_members; ++m) q_rows[m] = q_indptr[members[m]];
    // The scale goes on the few query rows, not on the [rows, keys] scores.
    const auto qg = (q.index_select(0, torch::tensor(q_rows, index)) * scale)
                        .view({n_members, kv_heads, group, dim})
                        .permute({1, 0, 2, 3})
                        .reshape({kv_heads, rows, dim});
    small_gemm::bmm(qg, k, scores);
    softmax_parts(scores.data_ptr<float>(), kv_heads * rows, keys, part.top.data_ptr<float>(),
                  part.total.data_ptr<float>());
    small_gemm::bmm(scores, v, part.acc);
    for (int64_t m = 0; m < n_members; ++m)
      items[members[m]] = ItemPart{keys, part.acc.data_ptr<float>(), part.top.data_ptr<float>(),
                                   part.total.data_ptr<float>(), rows, m * group};
    parts.push_back(std::move(part));
  }
  return parts;
}

}  // namespace shared_prefix
