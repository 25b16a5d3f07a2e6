// Paged attention for CPU: each new token attends straight to its item's cached slots in the
// KV pool (no gather copy), in fp32, with the 1-3 query heads of a KV head sharing each key load.
// Visibility follows pie/backend/attention.py: page mask bits, then the item's custom mask or
// the causal rule (key j visible to new token i iff j < n_context + i + 1).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
void attend(const float* q, const T* k_pool, const T* v_pool, float* out, const int64_t* q_indptr,
            const int64_t* kv_indptr, const int64_t* slots, const bool* visible,
            const int64_t* mask_offsets, const bool* masks, const bool* enabled, int64_t n_items,
            int64_t heads, int64_t kv_heads, int64_t dim, float scale) {
  const int64_t group = heads / kv_heads;
  at::parallel_for(0, n_items * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, key(dim), value(dim), acc;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / kv_heads, h = work % kv_heads;
      if (!enabled[b]) continue;
      const int64_t q0 = q_indptr[b], n_q = q_indptr[b + 1] - q0;
      const int64_t k0 = kv_indptr[b], n_k = kv_indptr[b + 1] - k0;
      const bool* mask = mask_offsets[b] >= 0 ? masks + mask_offsets[b] : nullptr;
      scores.assign(group * n_k, 0.f);
      acc.assign(group * dim, 0.f);
      for (int64_t i = 0; i < n_q; ++i) {
        const int64_t limit = mask ? n_k : n_k - n_q + i + 1;
        const float* qi = q + ((q0 + i) * heads + h * group) * dim;
        std::vector<float> top(group, -std::numeric_limits<float>::infinity());
        for (int64_t j = 0; j < limit; ++j) {
          const bool seen = visible[k0 + j] && (!mask || mask[i * n_k + j]);
          if (!seen) {
            for (int64_t g = 0; g < group; ++g) scores[g * n_k + j] = -INFINITY;
            continue;
          }
          const T* k_row = k_pool + (slots[k0 + j] * kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) key[d] = static_cast<float>(k_row[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qi + g * dim;
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < dim; ++d) s += qg[d] * key[d];
            s *= scale;
            scores[g * n_k + j] = s;
            top[g] = std::max(top[g], s);
          }
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        std::vector<float> total(group, 0.f);
        for (int64_t j = 0; j < limit; ++j) {
          if (scores[j] == -INFINITY) continue;  // hidden key: every head of a group shares it
          const T* v_row = v_pool + (slots[k0 + j] * kv_heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) value[d] = static_cast<float>(v_row[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float p = std::exp(scores[g * n_k + j] - top[g]);
            total[g] += p;
            float* a = acc.data() + g * dim;
#pragma omp simd
            for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          float* o = out + ((q0 + i) * heads + h * group + g) * dim;
          const float inv = 1.f / total[g];
          for (int64_t d = 0; d < dim; ++d) o[d] = acc[g * dim + d] * inv;
        }
      }
    }
  });
}

}  // namespace

// q: [T, heads, dim] fp32; k_pool/v_pool: [slots, kv_heads, dim] (fp32 or bf16); returns fp32.
// Items whose `enabled` flag is false are left for the caller (their output rows are zero).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor q_indptr, torch::Tensor kv_indptr, torch::Tensor slots,
                              torch::Tensor visible, torch::Tensor mask_offsets, torch::Tensor masks,
                              torch::Tensor enabled, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3);
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type());
  const int64_t n_items = q_indptr.size(0) - 1;
  auto out = torch::zeros_like(q);
  const int64_t heads = q.size(1), kv_heads = k_pool.size(1), dim = q.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && k_pool.size(2) == dim);
  const auto call = [&](auto* k, auto* v) {
    attend(q.data_ptr<float>(), k, v, out.data_ptr<float>(), q_indptr.data_ptr<int64_t>(),
           kv_indptr.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), visible.data_ptr<bool>(),
           mask_offsets.data_ptr<int64_t>(), masks.data_ptr<bool>(), enabled.data_ptr<bool>(),
           n_items, heads, kv_heads, dim, static_cast<float>(scale));
  };
  if (k_pool.scalar_type() == at::kBFloat16)
    call(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
  else
    call(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over a slot-addressed KV pool (CPU)");
}
