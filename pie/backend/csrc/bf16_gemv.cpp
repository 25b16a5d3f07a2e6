// y = x @ W.T for a few bf16 rows of x (a decode step's tokens, a short prompt), fp32
// accumulation, bf16 out.
// Why: at 1-4 tokens a linear is a stream over its weight, and oneDNN's bf16 primitive
// (prepacked) moved the 212 MB of a SmolLM2-135M step's layer weights at ~15 GB/s here
// (Xeon, avx512_bf16, 2 vCPUs) while the 57 MB LM head moved at ~25 GB/s: per-call setup
// dominates matrices of 0.7-3.5 MB. This loop reads each weight row once for all the tokens,
// 4 rows at a time (AVX-512 BF16 dot products into 16 fp32 lanes), split over the OpenMP
// threads by row blocks. Figures: pie/backend/linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>

namespace {

constexpr int64_t kMaxTokens = 16;
// Weight rows per inner block: M x rows accumulators + M x-vectors must fit 32 zmm registers.
constexpr int rows_per_block(int m) { return m <= 4 ? 4 : m <= 8 ? 2 : 1; }
#ifndef PF
#define PF 12
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kSupported = true;

inline __m512bh load_bh(const at::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// Rows [n0, n0 + R) of W against the M rows of x; k is a multiple of 32.
template <int M, int R>
inline void block(const at::BFloat16* x, const at::BFloat16* w, int64_t k, int64_t n0,
                  int64_t n, at::BFloat16* y) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += 32) {
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) xs[m] = load_bh(x + m * k + j);
    for (int r = 0; r < R; ++r) {
      const at::BFloat16* row = w + (n0 + r) * k + j;
      _mm_prefetch(reinterpret_cast<const char*>(row + PF * k), _MM_HINT_T0);
      const __m512bh wr = load_bh(row);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], xs[m], wr);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      y[m * n + n0 + r] = at::BFloat16(_mm512_reduce_add_ps(acc[m][r]));
}

template <int M>
void rows(const at::BFloat16* x, const at::BFloat16* w, int64_t k, int64_t n, int64_t begin,
          int64_t end, at::BFloat16* y) {
  constexpr int R = rows_per_block(M);
  int64_t i = begin;
  for (; i + R <= end; i += R) block<M, R>(x, w, k, i, n, y);
  for (; i < end; ++i) block<M, 1>(x, w, k, i, n, y);
}
#else
constexpr bool kSupported = false;
#endif

}  // namespace

bool supported() { return kSupported; }

int64_t max_tokens() { return kMaxTokens; }

torch::Tensor gemv(torch::Tensor x, torch::Tensor weight) {
  TORCH_CHECK(kSupported, "bf16_gemv: compiled without AVX-512 BF16 (check supported() first)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "bf16_gemv: x must be a contiguous bfloat16 [m, k] matrix");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "bf16_gemv: weight must be a contiguous bfloat16 [n, k] matrix");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k, "bf16_gemv: x has ", k, " columns, weight ", weight.size(1));
  TORCH_CHECK(k % 32 == 0, "bf16_gemv: k = ", k, " is not a multiple of 32");
  TORCH_CHECK(m >= 1 && m <= kMaxTokens, "bf16_gemv: ", m, " rows (1..", kMaxTokens, ")");
  auto y = torch::empty({m, n}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const auto* xp = x.data_ptr<at::BFloat16>();
  const auto* wp = weight.data_ptr<at::BFloat16>();
  auto* yp = y.data_ptr<at::BFloat16>();
  // Blocks of 64 rows (>= 36 KB of weight) per task: enough work to hide the fork.
  const int64_t blocks = (n + 63) / 64;
  at::parallel_for(0, blocks, 1, [&](int64_t b, int64_t e) {
    const int64_t lo = b * 64, hi = std::min(n, e * 64);
    switch (m) {
      case 1: rows<1>(xp, wp, k, n, lo, hi, yp); break;
      case 2: rows<2>(xp, wp, k, n, lo, hi, yp); break;
      case 3: rows<3>(xp, wp, k, n, lo, hi, yp); break;
      case 4: rows<4>(xp, wp, k, n, lo, hi, yp); break;
      case 5: rows<5>(xp, wp, k, n, lo, hi, yp); break;
      case 6: rows<6>(xp, wp, k, n, lo, hi, yp); break;
      case 7: rows<7>(xp, wp, k, n, lo, hi, yp); break;
      case 8: rows<8>(xp, wp, k, n, lo, hi, yp); break;
      case 9: rows<9>(xp, wp, k, n, lo, hi, yp); break;
      case 10: rows<10>(xp, wp, k, n, lo, hi, yp); break;
      case 11: rows<11>(xp, wp, k, n, lo, hi, yp); break;
      case 12: rows<12>(xp, wp, k, n, lo, hi, yp); break;
      case 13: rows<13>(xp, wp, k, n, lo, hi, yp); break;
      case 14: rows<14>(xp, wp, k, n, lo, hi, yp); break;
      case 15: rows<15>(xp, wp, k, n, lo, hi, yp); break;
      default: rows<16>(xp, wp, k, n, lo, hi, yp); break;
    }
  });
#endif
  return y;
}

#ifndef PIE_NO_BINDINGS  // csrc/decode_step.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the AVX-512 BF16 kernel");
  m.def("max_tokens", &max_tokens, "the most rows of x one call takes");
  m.def("gemv", &gemv, "y = x @ weight.T in bf16 for 1..max_tokens() rows of x");
}
#endif
