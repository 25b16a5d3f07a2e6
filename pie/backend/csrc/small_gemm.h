// Batched fp32 products C[h] = A[h] @ B[h] of shared-prefix attention's shapes (scores =
// queries @ prefix keys, then weights @ prefix values: a few dozen to a few hundred rows,
// 64-128 deep or 2,048 keys deep) on AVX2 + FMA CPUs without AVX-512, and on AMD's with it.
// Why: there at::bmm goes to MKL, which takes a generic path on AMD CPUs, and splits the
// batch of kv_heads (3 for SmolLM2) between 2 threads 2 : 1. On an AMD EPYC (Zen 1, 2 vCPUs),
// 3 x [96 x 64] @ [64 x 2,048] and 3 x [96 x 2,048] @ [2,048 x 64]: 43 and 45 GFLOP/s with
// at::bmm, 60-73 and 69-79 with this loop (tiles of 6 rows x 16 columns, A's element
// broadcast against 16 columns of B; the threads share the (head, column block, row block)
// tiles). On AMD CPUs with AVX-512 too: on an AMD EPYC 9004 (Zen 4, 2 vCPUs) a step of 32
// decoders reading a 2,048-key shared prompt took the shared-prefix path from 0.63x to 1.10x
// the speed of the same step without it per output token (benchmarks/shared_prompt.py, one
// run each), although in isolation one layer's at::bmm was no slower (2.3 against 2.6 ms,
// benchmarks/shared_prefix_attention.py; why MKL's call costs more inside a step was not
// isolated). On Intel CPUs (MKL's own kernels: 1.15x end to end on the Xeons measured here)
// at::bmm stays.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>

namespace small_gemm {

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kCols = 16;  // two ymm registers of C's row
constexpr int64_t kRows = 6;   // 6 x 2 accumulators + 2 of B + 1 broadcast fit the 16 registers

// C[0:R, 0:16] = A[0:R, 0:n] @ B[0:n, 0:16] (row strides lda, ldb, ldc).
// The accumulators are named variables, not an array: GCC kept an array of them in memory and
// stored all 12 on every step of the loop (36 against 69 GFLOP/s for the weights @ values).
template <int R>
inline void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n, float* c,
                 int64_t ldc) {
  __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0;
  __m256 y0 = x0, y1 = x0, y2 = x0, y3 = x0, y4 = x0, y5 = x0;
  for (int64_t t = 0; t < n; ++t) {
    const __m256 b0 = _mm256_loadu_ps(b + t * ldb), b1 = _mm256_loadu_ps(b + t * ldb + 8);
#define PIE_ROW(r)                                                     \
  if constexpr (R > r) {                                               \
    const __m256 s = _mm256_broadcast_ss(a + r * lda + t);             \
    x##r = _mm256_fmadd_ps(s, b0, x##r);                               \
    y##r = _mm256_fmadd_ps(s, b1, y##r);                               \
  }
    PIE_ROW(0) PIE_ROW(1) PIE_ROW(2) PIE_ROW(3) PIE_ROW(4) PIE_ROW(5)
#undef PIE_ROW
  }
#define PIE_STORE(r)                                                   \
  if constexpr (R > r) {                                               \
    _mm256_storeu_ps(c + r * ldc, x##r);                               \
    _mm256_storeu_ps(c + r * ldc + 8, y##r);                           \
  }
  PIE_STORE(0) PIE_STORE(1) PIE_STORE(2) PIE_STORE(3) PIE_STORE(4) PIE_STORE(5)
#undef PIE_STORE
}

// C's last columns past a whole block of 16 (keys of a page size that is no multiple of 16).
inline void tail(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n, float* c,
                 int64_t ldc, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) {
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t) sum += a[r * lda + t] * b[t * ldb + j];
      c[r * ldc + j] = sum;
    }
}

// Whether bmm() runs the loop above: on every AVX2 CPU without AVX-512, and on AMD's with it.
inline bool own_loop() {
#ifdef __AVX512F__
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
#else
  return true;
#endif
}

// c = a @ b for contiguous fp32 a [H, M, K], b [H, K, N], c [H, M, N].
inline void bmm(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& c) {
  if (!own_loop()) {
    at::bmm_out(c, a, b);
    return;
  }
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && c.is_contiguous() && a.scalar_type() == at::kFloat &&
                  b.scalar_type() == at::kFloat && c.scalar_type() == at::kFloat,
              "small_gemm::bmm: contiguous fp32 tensors");
  const int64_t heads = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  float* cp = c.data_ptr<float>();
  const int64_t col_blocks = n / kCols, row_blocks = (m + kRows - 1) / kRows, rest = n % kCols;
  // Row blocks innermost: a thread runs a column block's tiles one after another, so its 16
  // columns of B stay in L1 (K of 64) or L2 (K of 2,048) between them.
  at::parallel_for(0, heads * col_blocks * row_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i / (col_blocks * row_blocks), cb = i / row_blocks % col_blocks;
      const int64_t r = i % row_blocks * kRows, rows = std::min(kRows, m - r);
      const float* ar = ap + (h * m + r) * k;
      const float* bc = bp + h * k * n + cb * kCols;
      float* cr = cp + (h * m + r) * n + cb * kCols;
      switch (rows) {
        case 6: tile<6>(ar, k, bc, n, k, cr, n); break;
        case 5: tile<5>(ar, k, bc, n, k, cr, n); break;
        case 4: tile<4>(ar, k, bc, n, k, cr, n); break;
        case 3: tile<3>(ar, k, bc, n, k, cr, n); break;
        case 2: tile<2>(ar, k, bc, n, k, cr, n); break;
        default: tile<1>(ar, k, bc, n, k, cr, n); break;
      }
    }
  });
  if (rest > 0)
    for (int64_t h = 0; h < heads; ++h)
      tail(ap + h * m * k, k, bp + h * k * n + n - rest, n, k, cp + h * m * n + n - rest, n, m, rest);
}
#else
inline void bmm(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& c) { at::bmm_out(c, a, b); }
#endif

}  // namespace small_gemm
