// Causal attention for a prompt's new tokens in bf16 dot products (AVX-512 BF16): one item,
// its keys read from the paged pools by slot, every key visible (no page mask bit, no custom
// mask), key j visible to new token i iff j < n_context + i + 1.
// Why: a prompt's attention went to torch's SDPA in fp32, ~55-80 GFLOP/s here (one layer of
// SmolLM2-135M, 9 heads over 3 KV heads: 5.0 ms at 512 tokens, 10.4 at 850; AMD EPYC Zen 4,
// 2 vCPUs), a third of a 512-token prefill. This is a flash-attention loop: per KV head and
// block of 24 query rows (the head group's heads of 24 / group new tokens), each page of 16
// keys is scored with VDPBF16PS (a pair of dims per instruction, the keys repacked once per
// call as [page][dim pair][key][2]), the scores go through an online softmax in fp32, and the
// probabilities, rounded to bf16, weight the values (repacked as [page][key pair][dim][2]).
// Accumulation is fp32; what differs from fp32 SDPA is the bf16 probabilities (relative error
// ~2^-9 per weight; tests/test_attention.py holds the output to the reference).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_exp.h"

namespace prompt_attention {

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kSupported = true;
constexpr int kRows = 24;  // query rows per unit: 24 accumulators of 16 keys + the operands fit 32 zmm
constexpr int kKeys = 16;  // keys per page of the repacked layout (one zmm of fp32 scores)

using bf16 = at::BFloat16;

// e^x for x <= 0 (-inf: 0), 16 lanes: fast_exp.h's formula in AVX-512.
inline __m512 exp16(__m512 x) {
  const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 shift = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), shift), shift);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), xc));
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 e = _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), e);
}

struct Item {
  const bf16* q;  // [n_q, heads, D]
  bf16* out;  // [n_q, heads, D]
  int64_t n_q, n_k, n_ctx, heads, kv_heads, group;
  float scale;
};

// kRows query rows against keys [0, limit[r]) of one KV head's repacked keys and values (kp,
// vp: `pages` pages of 16 keys): scores in bf16 dot products, an online softmax in fp32 over
// blocks of kBlock pages, the probabilities rounded to bf16 weighting the values. Out: o[r],
// not yet divided by l[r] (the sum of e^(score - m[r])), and m[r] (the row's max score, scale
// applied). Every row sees the first `lo_limit` keys (pages wholly inside skip the per-row
// bound). Why blocks of 64 keys: the softmax's per-row work (two reductions, the rescale of
// o, e^(m_old - m_new)) is paid once per block, not per 16 keys; 32 decoders' rows over a
// 2,048-key shared prefix went from 1.20 to 0.89 ms a layer (AMD EPYC Zen 4, 2 vCPUs,
// one-off), and to ~0.73 with the accumulators in registers (below; docs/backend.md).
template <int D>
void flash_rows(const bf16* const* qr, const int64_t* limit, int64_t pages, int64_t lo_limit, const bf16* kp,
                const bf16* vp, float scale_value, float (*o)[D], float* m, float* l) {
  constexpr int kBlock = 4, kSpan = kBlock * kKeys;
  alignas(64) float sc[kRows][kSpan];      // this block's scaled scores
  alignas(64) uint16_t pw[kRows][kSpan];  // ... and probabilities in bf16
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.f;
    std::memset(o[r], 0, sizeof o[r]);
  }
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(scale_value);
  for (int64_t p0 = 0; p0 < pages; p0 += kBlock) {
    const int nb = static_cast<int>(std::min<int64_t>(kBlock, pages - p0));
    // Scores: q_r . k over each page's 16 keys, a dim pair per instruction.
    for (int b = 0; b < nb; ++b) {
      // The 24 accumulators stay in registers only with the row loops unrolled: GCC otherwise
      // keeps them in memory, a load and a store around every product (~40 % of the loop's time).
      __m512 acc[kRows];
#pragma GCC unroll 24
      for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
      const bf16* kpage = kp + (p0 + b) * (D / 2) * 2 * kKeys;
      for (int c = 0; c < D / 2; ++c) {
        const __m512bh kz = (__m512bh)_mm512_loadu_si512(kpage + c * 2 * kKeys);
#pragma GCC unroll 24
        for (int r = 0; r < kRows; ++r) {
          int32_t pair;
          std::memcpy(&pair, qr[r] + 2 * c, sizeof pair);
          acc[r] = _mm512_dpbf16_ps(acc[r], kz, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
#pragma GCC unroll 24
      for (int r = 0; r < kRows; ++r) _mm512_store_ps(sc[r] + b * kKeys, _mm512_mul_ps(acc[r], scale));
    }
    const int64_t k0 = p0 * kKeys;
    const bool whole = k0 + nb * kKeys <= lo_limit;  // every row sees every key of the block
    for (int r = 0; r < kRows; ++r) {
      if (limit[r] <= k0) {  // nothing of this block: no update (as -inf scores would give)
        std::memset(pw[r], 0, sizeof pw[r]);
        continue;
      }
      __m512 s[kBlock];
      __m512 top = _mm512_set1_ps(-INFINITY);
      for (int b = 0; b < nb; ++b) {
        s[b] = _mm512_load_ps(sc[r] + b * kKeys);
        if (!whole) {
          const int32_t left = static_cast<int32_t>(std::max<int64_t>(0, std::min<int64_t>(kKeys, limit[r] - k0 - b * kKeys)));
          s[b] = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(lanes, _mm512_set1_epi32(left)), _mm512_set1_ps(-INFINITY), s[b]);
        }
        top = _mm512_max_ps(top, s[b]);
      }
      const float m_new = std::max(m[r], _mm512_reduce_max_ps(top));
      const __m512 mv = _mm512_set1_ps(m_new);
      __m512 sum = _mm512_setzero_ps();
      for (int b = 0; b < nb; ++b) {
        const __m512 e = exp16(_mm512_sub_ps(s[b], mv));
        sum = _mm512_add_ps(sum, e);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pw[r] + b * kKeys), (__m256i)_mm512_cvtneps_pbh(e));
      }
      const float alpha = m[r] == -INFINITY ? 0.f : exp_nonpositive(m[r] - m_new);
      l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
      m[r] = m_new;
      if (alpha != 1.f)
        for (int d = 0; d < D; d += 16)
          _mm512_store_ps(o[r] + d, _mm512_mul_ps(_mm512_load_ps(o[r] + d), _mm512_set1_ps(alpha)));
    }
    // Values: o[r] += sum over the block's keys of p[r][key] * v[key], a key pair per instruction.
    const bf16* vblock = vp + p0 * (kKeys / 2) * 2 * D;
    constexpr int G = D <= 64 ? 6 : 3;  // rows at a time: G x D/16 accumulators
    for (int r0 = 0; r0 < kRows; r0 += G) {
      __m512 a[G][D / 16];
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D / 16; ++d) a[g][d] = _mm512_load_ps(o[r0 + g] + 16 * d);
      for (int kk = 0; kk < nb * kKeys / 2; ++kk) {
        const bf16* vrow = vblock + kk * 2 * D;
        for (int g = 0; g < G; ++g) {
          int32_t pair;
          std::memcpy(&pair, pw[r0 + g] + 2 * kk, sizeof pair);
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair);
          for (int d = 0; d < D / 16; ++d)
            a[g][d] = _mm512_dpbf16_ps(a[g][d], (__m512bh)_mm512_loadu_si512(vrow + 32 * d), pb);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < D / 16; ++d) _mm512_store_ps(o[r0 + g] + 16 * d, a[g][d]);
    }
  }
}

// One unit: KV head h, new tokens [i0, i0 + 24 / group). Kp, Vp: this head's repacked keys and
// values.
template <int D>
void unit(const Item& it, int64_t h, int64_t i0, const bf16* kp, const bf16* vp) {
  const int64_t per = kRows / it.group, i1 = std::min(it.n_q, i0 + per);
  const int64_t rows = (i1 - i0) * it.group;
  // Row r: new token i0 + r / group, query head h * group + r % group; past `rows`, a copy of
  // row 0 whose results are dropped.
  const bf16* qr[kRows];
  int64_t limit[kRows];  // keys row r sees
  for (int r = 0; r < kRows; ++r) {
    const int64_t rr = r < rows ? r : 0;
    qr[r] = it.q + ((i0 + rr / it.group) * it.heads + h * it.group + rr % it.group) * D;
    limit[r] = std::min(it.n_k, it.n_ctx + i0 + rr / it.group + 1);
  }
  alignas(64) float o[kRows][D];
  float m[kRows], l[kRows];
  const int64_t last = std::min(it.n_k, it.n_ctx + i1);  // keys any row sees
  flash_rows<D>(qr, limit, (last + kKeys - 1) / kKeys, std::min(it.n_ctx + i0 + 1, it.n_k), kp, vp, it.scale, o, m, l);
  for (int64_t r = 0; r < rows; ++r) {
    bf16* dst = it.out + ((i0 + r / it.group) * it.heads + h * it.group + r % it.group) * D;
    const float inv = 1.f / l[r];
    for (int d = 0; d < D; ++d) dst[d] = bf16(o[r][d] * inv);
  }
}

// Where the keys and values are: the paged pools by slot, or (chunked_forward.py) one item's
// fp32 copies [kv_heads, stride, D] of bf16 values.
struct PagedKeys {
  const bf16 *k_pool, *v_pool;
  const int64_t* slots;
  int64_t kv_heads, page_size, dim;
  float k(int64_t j, int64_t h, int64_t d) const {
    const int64_t slot = slots[j], page = slot / page_size, off = slot % page_size;
    return static_cast<float>(k_pool[((page * kv_heads + h) * dim + d) * page_size + off]);  // [dim][page_size]
  }
  float v(int64_t j, int64_t h, int64_t d) const {
    const int64_t slot = slots[j], page = slot / page_size, off = slot % page_size;
    return static_cast<float>(v_pool[((page * kv_heads + h) * page_size + off) * dim + d]);
  }
};

struct DenseKeys {
  const float *keys, *values;
  int64_t stride, dim;
  float k(int64_t j, int64_t h, int64_t d) const { return keys[(h * stride + j) * dim + d]; }
  float v(int64_t j, int64_t h, int64_t d) const { return values[(h * stride + j) * dim + d]; }
};

// Page p of the item's keys and values of KV head h, repacked: keys [D/2][16][2], values
// [8][D][2] (zero past n_k).
template <int D, typename Keys>
void repack(const Keys& src, int64_t n_k, int64_t h, int64_t p, bf16* kp, bf16* vp) {
  bf16* kd = kp + p * (D / 2) * 2 * kKeys;
  bf16* vd = vp + p * (kKeys / 2) * 2 * D;
  for (int j = 0; j < kKeys; ++j) {
    const int64_t key = p * kKeys + j;
    const bool real = key < n_k;
    for (int d = 0; d < D; ++d) {
      kd[(d / 2) * 2 * kKeys + 2 * j + d % 2] = bf16(real ? src.k(key, h, d) : 0.f);
      vd[(j / 2) * 2 * D + 2 * d + j % 2] = bf16(real ? src.v(key, h, d) : 0.f);
    }
  }
}

template <int D, typename Keys>
void run(const Item& it, const Keys& src) {
  const int64_t pages = (it.n_k + kKeys - 1) / kKeys;
  const int64_t k_size = pages * (D / 2) * 2 * kKeys, v_size = pages * (kKeys / 2) * 2 * D;
  std::vector<bf16> kp(it.kv_heads * k_size), vp(it.kv_heads * v_size);
  at::parallel_for(0, it.kv_heads * pages, 1, [&](int64_t b, int64_t e) {
    for (int64_t u = b; u < e; ++u)
      repack<D>(src, it.n_k, u / pages, u % pages, kp.data() + (u / pages) * k_size, vp.data() + (u / pages) * v_size);
  });
  // Units heaviest first (the last new tokens see the most keys), taken from a shared counter.
  const int64_t per = kRows / it.group, blocks = (it.n_q + per - 1) / per, units = blocks * it.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) {
      const int64_t block = blocks - 1 - u / it.kv_heads, h = u % it.kv_heads;
      unit<D>(it, h, block * per, kp.data() + h * k_size, vp.data() + h * v_size);
    }
  });
}
#else
constexpr bool kSupported = false;
#endif

// Whether this build and these shapes have the kernel.
inline bool supports(int64_t heads, int64_t kv_heads, int64_t dim) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return kv_heads > 0 && heads % kv_heads == 0 && kRows % (heads / kv_heads) == 0 && (dim == 64 || dim == 128);
#else
  (void)heads, (void)kv_heads, (void)dim;
  return false;
#endif
}

// q: [n_q, heads, dim] bf16 (contiguous); pools bf16 in paged_attention.cpp's layout; slots:
// the item's n_k keys (context, then the new tokens); returns [n_q, heads, dim] bf16.
inline torch::Tensor attend(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool, torch::Tensor slots,
                            int64_t n_context, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16, "prompt_attention: q must be contiguous bf16 [n, heads, dim]");
  TORCH_CHECK(k_pool.scalar_type() == at::kBFloat16 && v_pool.scalar_type() == at::kBFloat16 && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() && k_pool.dim() == 4, "prompt_attention: bf16 pools");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(), "prompt_attention: int64 slots");
  const int64_t n_q = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_pool.size(1);
  const int64_t page_size = k_pool.size(3), n_k = slots.size(0);
  TORCH_CHECK(supports(heads, kv_heads, dim), "prompt_attention: not for these shapes or this CPU (supports() first)");
  TORCH_CHECK(k_pool.size(2) == dim && v_pool.size(3) == dim, "prompt_attention: pools of another head size");
  TORCH_CHECK(n_context >= 0 && n_context + n_q == n_k && n_q > 0, "prompt_attention: n_context + new tokens must be the keys");
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t capacity = k_pool.size(0) * page_size;
  for (int64_t j = 0; j < n_k; ++j) TORCH_CHECK(s[j] >= 0 && s[j] < capacity, "prompt_attention: KV slot out of range");
  auto out = torch::empty_like(q);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const Item it{q.data_ptr<bf16>(), out.data_ptr<bf16>(), n_q, n_k, n_context, heads, kv_heads, heads / kv_heads,
                static_cast<float>(scale)};
  const PagedKeys src{k_pool.data_ptr<bf16>(), v_pool.data_ptr<bf16>(), s, kv_heads, page_size, dim};
  if (dim == 64) run<64>(it, src); else run<128>(it, src);
#endif
  return out;
}

// The same over one item's fp32 keys and values [kv_heads, N, dim] (chunked_forward.py holds
// them so; their values are bf16's), of which the first n_context + n_q are this call's.
inline torch::Tensor attend_dense(torch::Tensor q, torch::Tensor keys, torch::Tensor values, int64_t n_context,
                                  double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.scalar_type() == at::kBFloat16, "prompt_attention: q must be contiguous bf16 [n, heads, dim]");
  TORCH_CHECK(keys.dim() == 3 && keys.is_contiguous() && values.sizes() == keys.sizes() && values.is_contiguous() &&
                  keys.scalar_type() == at::kFloat && values.scalar_type() == at::kFloat,
              "prompt_attention: keys and values must be contiguous fp32 [kv_heads, N, dim]");
  const int64_t n_q = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = keys.size(0), n_k = n_context + n_q;
  TORCH_CHECK(supports(heads, kv_heads, dim) && keys.size(2) == dim, "prompt_attention: not for these shapes or this CPU");
  TORCH_CHECK(n_context >= 0 && n_q > 0 && n_k <= keys.size(1), "prompt_attention: n_context + new tokens exceed the keys");
  auto out = torch::empty_like(q);
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const Item it{q.data_ptr<bf16>(), out.data_ptr<bf16>(), n_q, n_k, n_context, heads, kv_heads, heads / kv_heads,
                static_cast<float>(scale)};
  const DenseKeys src{keys.data_ptr<float>(), values.data_ptr<float>(), keys.size(1), dim};
  if (dim == 64) run<64>(it, src); else run<128>(it, src);
#endif
  return out;
}

}  // namespace prompt_attention
