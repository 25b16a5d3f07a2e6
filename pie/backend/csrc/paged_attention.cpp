// Paged attention for CPU: each new token attends straight to its item's slots in the KV pools
// (no gather copy), in fp32, the query heads of a KV head sharing every key load.
// Pools (pie/backend/kv_cache.py): keys [pages, kv_heads, dim, page_size] (transposed within a
// page), values [pages, kv_heads, page_size, dim]; slot = page * page_size + offset.
// A run of keys filling one whole page is scored page_size lanes at a time with no horizontal
// sums; other keys (a partial last page, scratch slots) take a scalar path.
// Visibility follows pie/backend/attention.py: page mask bits, then the item's custom mask or
// the causal rule (key j visible to new token i iff j < n_context + i + 1).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(const float* p) { return *p; }
inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct Shape {
  int64_t heads, kv_heads, group, dim, page_size;
};

// Scores of one query's `group` heads against keys [0, limit) of one item and KV head `h`.
template <typename T, int PS>
void score(const float* q, const T* k_pool, const int64_t* slots, const bool* seen,
           int64_t limit, int64_t h, const Shape& s, float scale, float* scores, int64_t n_k) {
  int64_t j = 0;
  while (j < limit) {
    const int64_t slot = slots[j];
    const bool whole_page = PS > 0 && slot % PS == 0 && j + PS <= limit && slots[j + PS - 1] == slot + PS - 1;
    const T* base = k_pool + (slot / s.page_size) * (s.kv_heads * s.dim * s.page_size) + h * s.dim * s.page_size;
    if (whole_page) {
      for (int64_t g = 0; g < s.group; ++g) {
        float lanes[PS > 0 ? PS : 1] = {0.f};
        const float* qg = q + g * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) {
          const float qd = qg[d];
          const T* row = base + d * PS;
#pragma omp simd
          for (int l = 0; l < PS; ++l) lanes[l] += qd * load(row + l);
        }
        for (int l = 0; l < PS; ++l) scores[g * n_k + j + l] = seen[j + l] ? lanes[l] * scale : -INFINITY;
      }
      j += PS;
    } else {
      const int64_t offset = slot % s.page_size;
      for (int64_t g = 0; g < s.group; ++g) {
        float acc = 0.f;
        const float* qg = q + g * s.dim;
        for (int64_t d = 0; d < s.dim; ++d) acc += qg[d] * load(base + d * s.page_size + offset);
        scores[g * n_k + j] = seen[j] ? acc * scale : -INFINITY;
      }
      ++j;
    }
  }
}

template <typename T, int PS>
void attend(const float* q, const T* k_pool, const T* v_pool, float* out, const int64_t* q_indptr,
            const int64_t* kv_indptr, const int64_t* slots, const bool* visible,
            const int64_t* mask_offsets, const bool* masks, const bool* enabled, int64_t n_items,
            const Shape s, float scale) {
  at::parallel_for(0, n_items * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(s.group * s.dim), top(s.group), total(s.group);
    std::vector<char> seen;
    for (int64_t work = begin; work < end; ++work) {
      const int64_t b = work / s.kv_heads, h = work % s.kv_heads;
      if (!enabled[b]) continue;
      const int64_t q0 = q_indptr[b], n_q = q_indptr[b + 1] - q0;
      const int64_t k0 = kv_indptr[b], n_k = kv_indptr[b + 1] - k0;
      const bool* mask = mask_offsets[b] >= 0 ? masks + mask_offsets[b] : nullptr;
      scores.resize(s.group * n_k);
      seen.resize(n_k);
      for (int64_t i = 0; i < n_q; ++i) {
        const int64_t limit = mask ? n_k : n_k - n_q + i + 1;
        for (int64_t j = 0; j < limit; ++j) seen[j] = visible[k0 + j] && (!mask || mask[i * n_k + j]);
        const float* qi = q + ((q0 + i) * s.heads + h * s.group) * s.dim;
        score<T, PS>(qi, k_pool, slots + k0, reinterpret_cast<const bool*>(seen.data()), limit, h,
                     s, scale, scores.data(), n_k);
        for (int64_t g = 0; g < s.group; ++g) {
          float m = -INFINITY;
          for (int64_t j = 0; j < limit; ++j) m = std::max(m, scores[g * n_k + j]);
          float sum = 0.f;
          for (int64_t j = 0; j < limit; ++j) {
            const float p = seen[j] ? std::exp(scores[g * n_k + j] - m) : 0.f;
            scores[g * n_k + j] = p;
            sum += p;
          }
          top[g] = m;
          total[g] = sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t j = 0; j < limit; ++j) {
          if (!seen[j]) continue;
          const int64_t slot = slots[k0 + j];
          const T* v_row = v_pool + ((slot / s.page_size) * s.kv_heads + h) * s.page_size * s.dim +
                           (slot % s.page_size) * s.dim;
          for (int64_t g = 0; g < s.group; ++g) {
            const float p = scores[g * n_k + j];
            float* a = acc.data() + g * s.dim;
#pragma omp simd
            for (int64_t d = 0; d < s.dim; ++d) a[d] += p * load(v_row + d);
          }
        }
        for (int64_t g = 0; g < s.group; ++g) {
          float* o = out + ((q0 + i) * s.heads + h * s.group + g) * s.dim;
          const float inv = 1.f / total[g];
          for (int64_t d = 0; d < s.dim; ++d) o[d] = acc[g * s.dim + d] * inv;
        }
      }
    }
  });
}

}  // namespace

// q: [T, heads, dim] fp32; pools as above (fp32 or bf16); returns fp32 [T, heads, dim].
// Items whose `enabled` flag is false are left for the caller (their output rows are zero).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor q_indptr, torch::Tensor kv_indptr, torch::Tensor slots,
                              torch::Tensor visible, torch::Tensor mask_offsets, torch::Tensor masks,
                              torch::Tensor enabled, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4);
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type());
  const Shape s{q.size(1), k_pool.size(1), q.size(1) / k_pool.size(1), q.size(2), k_pool.size(3)};
  TORCH_CHECK(s.heads % s.kv_heads == 0 && k_pool.size(2) == s.dim && v_pool.size(3) == s.dim);
  auto out = torch::zeros_like(q);
  const int64_t n_items = q_indptr.size(0) - 1;
  const auto call = [&](auto* k, auto* v, auto page_size) {
    constexpr int PS = decltype(page_size)::value;
    attend<std::remove_const_t<std::remove_pointer_t<decltype(k)>>, PS>(
        q.data_ptr<float>(), k, v, out.data_ptr<float>(), q_indptr.data_ptr<int64_t>(),
        kv_indptr.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), visible.data_ptr<bool>(),
        mask_offsets.data_ptr<int64_t>(), masks.data_ptr<bool>(), enabled.data_ptr<bool>(),
        n_items, s, static_cast<float>(scale));
  };
  const auto dispatch = [&](auto* k, auto* v) {
    // Page sizes with a vectorised whole-page path; any other size takes the scalar path.
    switch (s.page_size) {
      case 16: call(k, v, std::integral_constant<int, 16>{}); break;
      case 32: call(k, v, std::integral_constant<int, 32>{}); break;
      case 8: call(k, v, std::integral_constant<int, 8>{}); break;
      default: call(k, v, std::integral_constant<int, 0>{}); break;
    }
  };
  if (k_pool.scalar_type() == at::kBFloat16)
    dispatch(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>());
  else
    dispatch(k_pool.data_ptr<float>(), v_pool.data_ptr<float>());
  return out;
}

// Writes k, v ([n, kv_heads, dim], the pools' dtype) to `slots` of the pools. A plain serial
// loop: torch's advanced-index assignment spends milliseconds in OpenMP barriers for these
// few kilobytes when the other core is busy (the control process usually is).
void write_kv(torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots, torch::Tensor k, torch::Tensor v) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k.is_contiguous() && v.is_contiguous());
  TORCH_CHECK(k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == v_pool.scalar_type());
  TORCH_CHECK(slots.scalar_type() == at::kLong && k.dim() == 3 && k.sizes() == v.sizes());
  const int64_t n = slots.size(0), kv_heads = k_pool.size(1), dim = k_pool.size(2), ps = k_pool.size(3);
  TORCH_CHECK(k.size(0) == n && k.size(1) == kv_heads && k.size(2) == dim);
  const int64_t capacity = k_pool.size(0) * ps;
  const int64_t* slot = slots.data_ptr<int64_t>();
  const auto copy = [&](auto* kp, auto* vp, const auto* ks, const auto* vs) {
    for (int64_t i = 0; i < n; ++i) {
      TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "KV slot out of range");
      const int64_t page = slot[i] / ps, offset = slot[i] % ps;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const auto* k_row = ks + (i * kv_heads + h) * dim;
        auto* k_dst = kp + (page * kv_heads + h) * dim * ps + offset;
        for (int64_t d = 0; d < dim; ++d) k_dst[d * ps] = k_row[d];
        std::memcpy(vp + ((page * kv_heads + h) * ps + offset) * dim, vs + (i * kv_heads + h) * dim,
                    dim * sizeof(*vs));
      }
    }
  };
  if (k_pool.scalar_type() == at::kBFloat16)
    copy(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(),
         v.data_ptr<at::BFloat16>());
  else
    copy(k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the KV page pools (CPU)");
  m.def("write_kv", &write_kv, "write new keys and values to their slots in the pools (CPU)");
}
