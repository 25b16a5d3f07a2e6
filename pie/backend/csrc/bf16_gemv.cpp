// y = x @ W.T for a few bf16 rows of x (a decode step's tokens, a short prompt), fp32
// accumulation, bf16 out.
// Why: at 1-4 tokens a linear is a stream over its weight, and oneDNN's bf16 primitive
// (prepacked) moved the 212 MB of a SmolLM2-135M step's layer weights at ~15 GB/s here
// (Xeon, avx512_bf16, 2 vCPUs) while the 57 MB LM head moved at ~25 GB/s: per-call setup
// dominates matrices of 0.7-3.5 MB. This loop reads each weight row once for all the tokens,
// from a copy of the weight in 4-row panels that makes every 4 rows one sequential stream
// (AVX-512 BF16 dot products into 16 fp32 lanes), split over the OpenMP threads by row
// blocks; on AVX2 CPUs the same loop widens bf16 to fp32 (below; its GEMM tiles in 512-bit
// vectors where the CPU has AVX-512 without BF16). Figures:
// pie/backend/linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <cstdint>

#include <sys/syscall.h>
#include <unistd.h>

namespace {

// Tokens per pass over the weight rows (the kernels' templates go up to it), and per call:
// with AVX2 a call of 17-32 tokens makes two passes over each block of kBlockRows (the second
// from L1). Measured on an AMD EPYC (AVX2, 2 vCPUs), the 120 layer linears of a SmolLM2-135M
// step: 14.6 / 40.8 / 69.2 ms at 1 / 8 / 16 tokens against fp32 F.linear's 43.8 / 120 / 148
// (its weight twice the bytes; MKL reached 34 GFLOP/s at 32 tokens, this loop ~49).
constexpr int64_t kPassTokens = 16;
// Weight rows per block (the unit the threads share, and that every pass covers before the
// next block). 64-row blocks split a 576-row projection 5 : 4 between 2 threads, and each
// pass of a 17-32-token call streamed a thread's whole share (up to 1.8 MB, past L2) before
// the next pass read it all again.
constexpr int64_t kBlockRows = 16;
// The most tokens a call takes without a wide weight (pack_wide()), and the most a fused
// decode step takes (csrc/decode_step.cpp): past 32 an item's attention leaves the paged
// kernel (CpuKernelAttention.PREFILL_TOKENS).
constexpr int64_t kMaxTokens = 32;

// How far ahead (bytes) the GEMM tiles (below, all three builds) prefetch each of their weight
// blocks' streams. A 12-token tile of the AVX-512 BF16 build does 24 dot products per 64-byte
// line of each block, and without it the out-of-order window reached too few lines ahead for
// the memory's latency: the 120 layer linears (weights not in cache, wide copies in huge pages
// as linear.py places them) at 6 / 12 / 32 / 128 tokens took 5.88 / 8.15 / 11.86 / 34.3 ms
// without, 4.07 / 4.68 / 9.14 / 30.7 at 4 KB ahead, 4.23 / 4.93 / 9.34 / 31.1 at 2 KB (AMD EPYC
// Zen 5, 2 vCPUs, alternating in one process, 2026-12-07; 8 KB was 3-8 % behind 4 KB). The
// same CPU running the AVX2 build: 11.6 / 17.7 / 32.0 ms at 8 / 16 / 32 tokens without, 9.7 /
// 14.8 / 28.6 at 4 KB; the AVX-512 build without BF16: 7.3 / 10.8 / 18.4 against 5.4 / 9.4 /
// 17.1 (not measured on the CPUs those builds are for). The tiles after a block's first read
// it from L1/L2, where the prefetch finds its lines already there.
constexpr int64_t kTileAhead = 4096;

#if defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kSupported = true;
// The weight is read from 4-row panels (pack(): [n/4][k/32][4][32], row r's columns j..j+31
// at panel r/4, step j/32, lane r%4), so the 4 rows of a block are one sequential stream of
// 64-byte lines; in the plain [n][k] layout they were 4 streams a row apart. Measured on an
// AMD EPYC Zen 4 (avx512_bf16, 2 vCPUs), 30 layers' 120 linears at 1 token, weights
// streamed from DRAM: 10.9 ms plain (with software prefetch 12 rows ahead; without, 10.6)
// against 6.9 ms in panels without prefetch (4 and 8 KB ahead: 8.1, 7.3 ms), all in
// huge pages (weight_arena.py; plain 11.5 against panels 8.1 in 4 KB pages). A panel's
// stream needs no software prefetch: the hardware's stream prefetcher follows it.
constexpr int64_t kPanelRows = 4;
constexpr int64_t kPanelCols = 32;  // one 64-byte line of bf16
inline torch::Tensor to_panels(const torch::Tensor& w) {
  return w.view({w.size(0) / 4, 4, w.size(1) / kPanelCols, kPanelCols}).permute({0, 2, 1, 3});
}

inline __m512bh load_bh(const at::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// The 4 row sums of a, b, c, d (16 lanes each) as one vector {sum a, sum b, sum c, sum d}:
// 9 shuffles and adds for 4 reductions (_mm512_reduce_add_ps took ~8 each).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: {a0+a2, b0+b2, a1+a3, b1+b3} and the same of c, d
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// 4 floats to bf16, rounded to nearest even as at::BFloat16 is (NaN to 0x7FC0).
inline void store4(__m128 v, at::BFloat16* y) {
  alignas(16) float s[4];
  _mm_store_ps(s, v);
  for (int r = 0; r < 4; ++r) y[r] = at::BFloat16(s[r]);
}

// How far ahead (bytes) panel() prefetches its stream where a call has 2 or more tokens. At
// 2-5 tokens the dot products between two lines' loads outgrow what the out-of-order window
// covers, and the hardware's prefetcher alone fell behind: the 120 layer linears in huge
// pages at 2 / 4 / 5 tokens took 5.49 / 6.16 / 6.46 ms without, 4.63 / 4.97 / 5.29 at 4 KB
// ahead (AMD EPYC Zen 5, 2 vCPUs, variants alternating in one process, 2026-12-07). At one
// token it was level (4.77 / 4.75 ms), and on a Zen 4 it had cost (6.9 ms without, 7.3-8.1
// with): one-token calls keep the hardware's prefetcher alone.
constexpr int64_t kPanelAhead = 4096;

// G tokens of x against one panel p (4 weight rows); y's row stride is n. `ahead`: prefetch.
template <int G, bool ahead = false>
inline void panel(const at::BFloat16* x, const at::BFloat16* p, int64_t k, at::BFloat16* y, int64_t n) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += kPanelCols, p += kPanelRows * kPanelCols) {
    if constexpr (ahead)
      for (int line = 0; line < 4; ++line)  // a panel step is 4 lines of 64 bytes
        _mm_prefetch(reinterpret_cast<const char*>(p) + kPanelAhead + 64 * line, _MM_HINT_T0);
    const __m512bh w0 = load_bh(p), w1 = load_bh(p + 32), w2 = load_bh(p + 64), w3 = load_bh(p + 96);
    for (int g = 0; g < G; ++g) {
      const __m512bh xv = load_bh(x + g * k + j);
      acc[g][0] = _mm512_dpbf16_ps(acc[g][0], xv, w0);
      acc[g][1] = _mm512_dpbf16_ps(acc[g][1], xv, w1);
      acc[g][2] = _mm512_dpbf16_ps(acc[g][2], xv, w2);
      acc[g][3] = _mm512_dpbf16_ps(acc[g][3], xv, w3);
    }
  }
  for (int g = 0; g < G; ++g) store4(sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), y + g * n);
}

// All M tokens against panels [begin, end): each panel once per group of up to 4 tokens
// (the later groups read it from L1: 4.6-12 KB for this model's widths). Groups of 6 would
// fit the 32 zmm registers too (24 accumulators) but ran 5-18 % slower at 6-12 tokens
// (the 120 layer linears and LM head, Zen 4).
template <int M>
void rows(const at::BFloat16* x, const at::BFloat16* w, int64_t k, int64_t n, int64_t begin,
          int64_t end, at::BFloat16* y) {
  constexpr int G = M < 4 ? M : 4;
  constexpr int rest = M % G;
  for (int64_t i = begin; i < end; i += kPanelRows) {
    const at::BFloat16* p = w + i * k;
    // The first group streams the panel (prefetching from 2 tokens on), the rest read it from L1.
    panel<G, (M > 1)>(x, p, k, y + i, n);
    int t = G;
    for (; t + G <= M; t += G) panel<G>(x + t * k, p, k, y + t * n + i, n);
    if constexpr (rest > 0) panel<rest>(x + t * k, p, k, y + t * n + i, n);
  }
}

using XType = at::BFloat16;  // x as the dot products read it: x itself
constexpr bool kWidens = false;

// From kWideFrom tokens on, GEMM tiles: x's column pair (x[t][2j], x[t][2j+1]) broadcast
// against 16 weight rows' pairs at those columns, one VDPBF16PS per 16 rows and token, 12
// tokens x 32 rows (24 accumulators) a tile. The loop above instead sums each (token, row)
// across 16 lanes and reduces them at the end, and re-reads x for every 4 rows.
// It reads W in a second layout, `pack_wide()`: [n/16, k/2, 16, 2] (16 rows' column pairs
// side by side), x in place. Sums run over k in column pairs, in order, one accumulator per
// (token, row): a row's result does not depend on the tokens beside it or their number
// (the loop above sums in another order: results agree to fp32 rounding, not bit for bit).
// The 120 layer linears of a SmolLM2-135M step, weights not in cache (AMD EPYC Zen 4, 2 vCPUs,
// 2026-12-02, two runs on a noisy VM): 11.8-15.4 ms at 16 tokens against the loop's
// 17.7-23.1 and oneDNN's 17.3-19.6, 19.4-21.1 at 32 against oneDNN's 23.6-26.1, 72.3-72.4 at
// 128 against 75.4-81.0, 146 at 255 against 161; level with the loop at 1-4 tokens, ahead
// from 6 (8.8 vs 11.8 ms at 6 in one run, 6.8 vs 7.3 in the other). Past 255 oneDNN keeps
// the prefills (chunked_forward.py's chunks, 256 rows and up, stay on one library).
constexpr int64_t kWideRows = 16;
constexpr int64_t kWideFrom = 6;
constexpr int64_t kWideTo = 255;
constexpr int kTileTokens = 12;
inline torch::Tensor to_wide(const torch::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1);
  return w.view({n / kWideRows, kWideRows, k / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({n / kWideRows, k, kWideRows});
}

// y[0:R, 0:16 B] (row stride n) = x[0:R, 0:k] (row stride k) @ B blocks of W (pack_wide).
template <int R, int B>
inline void wide_tile(const at::BFloat16* x, int64_t k, const at::BFloat16* w0, const at::BFloat16* w1,
                      at::BFloat16* y, int64_t n) {
  __m512 acc[B][R];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[b][r] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // column pairs
  const int64_t pairs = k / 2;
  for (int64_t j = 0; j < pairs; ++j) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + j * 2 * kWideRows) + kTileAhead, _MM_HINT_T0);
    if constexpr (B > 1) _mm_prefetch(reinterpret_cast<const char*>(w1 + j * 2 * kWideRows) + kTileAhead, _MM_HINT_T0);
    const __m512bh a = load_bh(w0 + j * 2 * kWideRows);
    const __m512bh b = B > 1 ? load_bh(w1 + j * 2 * kWideRows) : a;
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const __m512bh s = (__m512bh)_mm512_set1_epi32(xp[r * pairs + j]);
      acc[0][r] = _mm512_dpbf16_ps(acc[0][r], s, a);
      if constexpr (B > 1) acc[B - 1][r] = _mm512_dpbf16_ps(acc[B - 1][r], s, b);
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + b * kWideRows), (__m256i)_mm512_cvtneps_pbh(acc[b][r]));
}

template <int B>
inline void wide_tile_of(int64_t rows, const at::BFloat16* x, int64_t k, const at::BFloat16* w0,
                         const at::BFloat16* w1, at::BFloat16* y, int64_t n) {
  switch (rows) {
    case 12: return wide_tile<12, B>(x, k, w0, w1, y, n);
    case 11: return wide_tile<11, B>(x, k, w0, w1, y, n);
    case 10: return wide_tile<10, B>(x, k, w0, w1, y, n);
    case 9: return wide_tile<9, B>(x, k, w0, w1, y, n);
    case 8: return wide_tile<8, B>(x, k, w0, w1, y, n);
    case 7: return wide_tile<7, B>(x, k, w0, w1, y, n);
    case 6: return wide_tile<6, B>(x, k, w0, w1, y, n);
    case 5: return wide_tile<5, B>(x, k, w0, w1, y, n);
    case 4: return wide_tile<4, B>(x, k, w0, w1, y, n);
    case 3: return wide_tile<3, B>(x, k, w0, w1, y, n);
    case 2: return wide_tile<2, B>(x, k, w0, w1, y, n);
    default: return wide_tile<1, B>(x, k, w0, w1, y, n);
  }
}

// y's columns of weight blocks [b, e) (16 rows each, two at a time) for all m tokens, in
// tiles of at most kTileTokens tokens, as even as they can be; a block pair's tiles run one
// after another, so its W (18-48 KB) is re-read from L1/L2.
inline void wide_blocks(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* w, int64_t n,
                        int64_t b, int64_t e, at::BFloat16* y) {
  const int64_t tiles = (m + kTileTokens - 1) / kTileTokens;
  for (int64_t blk = b; blk < e; blk += 2) {
    const at::BFloat16* w0 = w + blk * kWideRows * k;
    at::BFloat16* yb = y + blk * kWideRows;
    for (int64_t i = 0, t = 0; i < tiles; ++i) {
      const int64_t rows = (m - t) / (tiles - i) + ((m - t) % (tiles - i) != 0);
      if (blk + 1 < e) wide_tile_of<2>(rows, x + t * k, k, w0, w0 + kWideRows * k, yb + t * n, n);
      else wide_tile_of<1>(rows, x + t * k, k, w0, w0, yb + t * n, n);
      t += rows;
    }
  }
}
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// With AMX (Xeons from Sapphire Rapids on) the same wide layout is the VNNI layout AMX's
// TDPBF16PS reads for its B tile: 16 column pairs of a 16-row block are 16 lines of 64 bytes,
// one 1 KB tile. So calls of kAmxFrom to kMaxTokens rows run on tiles instead: x's rows in
// one or two A tiles (16 rows x 32 columns each), two weight blocks in two B tiles, four
// 16 x 16 fp32 accumulator tiles. Why: on a Xeon with AMX (family 6 model 207, 2 vCPUs,
// 2026-12-05) oneDNN's AMX kernels had taken linears from 8 rows (linear.py,
// AMX_ONEDNN_FROM), so steps of 8-32 rows left the fused decode step (decode_step.cpp) for
// the op loop. The 120 layer linears of a SmolLM2-135M step on these tiles (with kAmxAhead)
// took 10.6 / 11.3 / 11.7 / 15.0 ms at 1 / 8 / 16 / 32 rows against oneDNN's 23.0 / 23.0 /
// 23.2 / 32.3, the LM head 1.6 / 1.7 / 2.6 against 3.5 / 3.7 / 6.2; before the prefetch, at 1
// / 2 / 4 rows 14.5 / 14.4 / 14.8 ms against the 4-row panels' 15.9 / 19.8 / 23.0
// (alternating, one process), so they start at one row. Whole in-process decode steps at
// context 128: 18.0 / 23.4 / 33.1 ms at batch 8 / 16 / 32 against 40.3 / 45.7 / 65.0 with
// oneDNN from 8 rows (docs/backend.md). Sums run over k in 32-column
// chunks, each chunk's 16 pairs as TDPBF16PS sums them: a row's result does not depend on the
// rows beside it (1-32), and agrees with the VDPBF16PS tiles above to fp32 rounding, not bit
// for bit.
#define PIE_AMX 1
constexpr int64_t kAmxFrom = 1;  // every call of up to kMaxTokens rows (see above)
// How far ahead of a B tile's load its next lines are prefetched (bytes): the hardware's
// prefetcher does not follow tile loads well. The 120 layer linears at 1 / 4 / 16 / 32 rows,
// alternating in one process (2026-12-05): no prefetch 12.7 / 12.6 / 12.8 / 20.1 ms; 512
// ahead 10.0 / 10.1 / 10.3 / 14.7; 1024 9.7 / 9.7 / 10.2 / 13.1; 2048 9.5 / 9.2 / 10.6 / 13.3
// (9.7 ms is 22 GB/s, what a torch sum over 256 MB reads here). One tile (1 KB) ahead: the
// next 32 columns' B tile of the same block.
constexpr int64_t kAmxAhead = 1024;

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Linux (5.16 on) gives a process AMX's tile state only when asked, once per process
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile
// instruction kills the process. Asked once; false where the kernel refuses.
inline bool amx_permitted() {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return permitted;
}

// Tiles: 0-3 the accumulators (row chunk 0/1 x block 0/1), 4-5 x's row chunks, 6-7 the blocks.
inline void amx_configure(int64_t m) {
  TileConfig cfg{};
  cfg.palette = 1;
  const uint8_t m0 = static_cast<uint8_t>(std::min<int64_t>(m, 16)), m1 = static_cast<uint8_t>(m - m0);
  const uint8_t rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = rows[i];
    cfg.colsb[i] = rows[i] ? 64 : 0;
  }
  _tile_loadconfig(&cfg);
}

// c[0:m, 0:32] (fp32, row stride 32) = x[0:m, 0:k] @ blocks w0, w1 (wide layout).
template <bool M2, bool N2>
inline void amx_pair(const at::BFloat16* x, int64_t k, const at::BFloat16* w0, const at::BFloat16* w1, float* c) {
  _tile_zero(0);
  if constexpr (N2) _tile_zero(1);
  if constexpr (M2) _tile_zero(2);
  if constexpr (M2 && N2) _tile_zero(3);
  const int64_t stride = k * 2;
  for (int64_t j = 0; j < k; j += 32) {
    _tile_loadd(4, x + j, stride);
    if constexpr (M2) _tile_loadd(5, x + 16 * k + j, stride);
    const char* p0 = reinterpret_cast<const char*>(w0 + j * kWideRows) + kAmxAhead;
    const char* p1 = reinterpret_cast<const char*>(w1 + j * kWideRows) + kAmxAhead;
    for (int l = 0; l < 1024; l += 64) {
      _mm_prefetch(p0 + l, _MM_HINT_T0);
      if constexpr (N2) _mm_prefetch(p1 + l, _MM_HINT_T0);
    }
    _tile_loadd(6, w0 + j * kWideRows, 64);
    if constexpr (N2) _tile_loadd(7, w1 + j * kWideRows, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (N2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (M2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (M2 && N2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  if constexpr (N2) _tile_stored(1, c + 16, 128);
  if constexpr (M2) _tile_stored(2, c + 16 * 32, 128);
  if constexpr (M2 && N2) _tile_stored(3, c + 16 * 32 + 16, 128);
}

// y's columns of weight blocks [b, e) for m <= kMaxTokens rows of x (in place), W from pack_wide().
inline void amx_blocks(const at::BFloat16* x, int64_t m, int64_t k, const at::BFloat16* w, int64_t n,
                       int64_t b, int64_t e, at::BFloat16* y) {
  amx_configure(m);
  alignas(64) float c[32 * 32];
  const bool m2 = m > 16;
  for (int64_t blk = b; blk < e; blk += 2) {
    const at::BFloat16* w0 = w + blk * kWideRows * k;
    const bool n2 = blk + 1 < e;
    if (m2) {
      if (n2) amx_pair<true, true>(x, k, w0, w0 + kWideRows * k, c); else amx_pair<true, false>(x, k, w0, w0, c);
    } else {
      if (n2) amx_pair<false, true>(x, k, w0, w0 + kWideRows * k, c); else amx_pair<false, false>(x, k, w0, w0, c);
    }
    for (int64_t r = 0; r < m; ++r)
      for (int h = 0; h < (n2 ? 2 : 1); ++h)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * n + (blk + h) * kWideRows),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + r * 32 + h * 16)));
  }
}
#endif
#define PIE_WIDE 1
#elif defined(__AVX2__) && defined(__FMA__)
// CPUs without bf16 arithmetic (AVX2 + FMA, e.g. AMD EPYC before Zen 4): the weight stays
// bf16 in memory, which is what a few-token linear is bound by, and each 8 bf16 become 8
// fp32 by a shift (bf16 is fp32's upper half) before an fp32 FMA. Products and sums are
// fp32 as with AVX-512 BF16's dot products; only the order of the sums differs.
constexpr bool kSupported = true;

inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The weight is read from 4-row panels (pack() below: [n/4][k/8][4][8], row r's columns
// j..j+7 at panel r/4, step j/8, lane r%4), so a block of 4 rows is one sequential stream of
// 64-byte lines, prefetched kPrefetch elements ahead; in the plain [n][k] layout the same
// block was 4 streams a row apart, prefetched 12 rows ahead. The 120 layer linears of a
// SmolLM2-135M step (AMD EPYC, 2 vCPUs, one session): 13.9 against 16.8 ms at 1 token, 20.3
// against 22.8 at 4, level from 16 (~86 % of an fp32 sum's bandwidth at 1 token, ~70 % before);
// the products and their order are unchanged, so y is bit-identical to the plain layout's.
constexpr int64_t kPanelRows = 4;
constexpr int64_t kPanelCols = 8;  // one 32-byte vector of bf16
inline torch::Tensor to_panels(const torch::Tensor& w) {
  return w.view({w.size(0) / 4, 4, w.size(1) / kPanelCols, kPanelCols}).permute({0, 2, 1, 3});
}
constexpr int64_t kPrefetch = 1024;  // 2 KB ahead: 0 / 512 / 1024 / 2048 elements measured, 1024 best

inline const at::BFloat16* panel_row(const at::BFloat16* w, int64_t k, int64_t r) {
  return w + (r / kPanelRows) * kPanelRows * k + (r % kPanelRows) * 8;
}

// x is widened to fp32 once per call (`widen`, at most 32 x k floats) and each 8 of a row
// loaded once per R weight rows. A block is G <= 6 tokens against R weight rows: G x R
// accumulators + R weight vectors + one x vector fit the 16 ymm registers; more tokens pass
// over the same R rows again (from L1) in groups of 6 rather than spill. 120 layer linears
// (AMD EPYC, 2 vCPUs, weights streamed, plain layout): 36.7 / 63.1 / 123.7 ms at 8 / 16 / 32
// tokens with the load in a register, 42.0 / 68.0 / 132.5 with GCC's folded loads.
template <int G, int R>
inline void block(const float* x, const at::BFloat16* w, int64_t k, int64_t n0, int64_t n,
                  at::BFloat16* y) {
  const at::BFloat16* row[R];
  bool fetch[R];  // one prefetch per panel the block touches (a line holds all 4 of its rows)
  for (int r = 0; r < R; ++r) {
    row[r] = panel_row(w, k, n0 + r);
    fetch[r] = r == 0 || (n0 + r) % kPanelRows == 0;
  }
  __m256 acc[G][R];
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < k; j += 8) {
    __m256 wr[R];
    for (int r = 0; r < R; ++r) {
      const at::BFloat16* p = row[r] + j * kPanelRows;
      if (fetch[r]) _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetch), _MM_HINT_T0);
      wr[r] = load8(p);
    }
    for (int g = 0; g < G; ++g) {
      __m256 xg = _mm256_loadu_ps(x + g * k + j);
      // Keep xg in a register: GCC otherwise folds the load into each of the R FMAs, and
      // Zen 1 splits a 256-bit load in two, so the loop was bound by loads (26 per 12 FMAs).
      __asm__("" : "+x"(xg));
      for (int r = 0; r < R; ++r) acc[g][r] = _mm256_fmadd_ps(xg, wr[r], acc[g][r]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int r = 0; r < R; ++r) y[g * n + n0 + r] = at::BFloat16(hsum(acc[g][r]));
}

// All M tokens against rows [n0, n0 + R), a group of G tokens at a time.
template <int M, int G, int R>
inline void groups(const float* x, const at::BFloat16* w, int64_t k, int64_t n0, int64_t n,
                   at::BFloat16* y) {
  int t = 0;
  for (; t + G <= M; t += G) block<G, R>(x + t * k, w, k, n0, n, y + t * n);
  constexpr int rest = M % G;
  if constexpr (rest > 0) block<rest, R>(x + (M - rest) * k, w, k, n0, n, y + (M - rest) * n);
}

template <int M>
void rows(const float* x, const at::BFloat16* w, int64_t k, int64_t n, int64_t begin,
          int64_t end, at::BFloat16* y) {
  constexpr int G = M < 6 ? M : 6;
  constexpr int R = G <= 2 ? 4 : G <= 4 ? 3 : 2;
  int64_t i = begin;
  for (; i + R <= end; i += R) groups<M, G, R>(x, w, k, i, n, y);
  for (; i < end; ++i) groups<M, G, 1>(x, w, k, i, n, y);
}

using XType = float;  // x widened to fp32 once per call (exact)
constexpr bool kWidens = true;

// From kWideFrom tokens on, the loop above re-reads every x row for each 2 weight rows, and at
// 32 tokens x (32 x k fp32, 74-197 KB) no longer fits L1: each FMA waited for a 32-byte load
// from L2 (the 120 layer linears at ~45 GFLOP/s). There a GEMM tile does better: 6 tokens
// x 16 weight rows, x's element broadcast against 16 rows of W at one column, so an x load
// serves 2 FMAs and W's 16 x k block (18-48 KB) is re-read from L1/L2 by the next tile.
// It reads W in a second layout, `pack_wide()`: [n/16, k, 16], each column's 16 rows as
// pairs (row r, row r + 8), so one 32-byte load widens into rows 0-7 (a shift) and 8-15 (a
// mask). Sums run over k in order, one accumulator per (token, row): a different rounding
// order from the loop above (results agree to fp32 rounding, not bit for bit).
// Up to kWideTo tokens: a SmolLM2-135M prefill's linears took 223 against 261 ms at 64 tokens
// through oneDNN's fp32 kernels on an fp32 copy, 411 against 449 at 128, level at 256, and
// 1,639-1,728 against 1,558-1,574 at 512, where x no longer fits L2 (blocking over 48 tokens
// at a time still lost 3-6 % there).
constexpr int64_t kWideRows = 16;
constexpr int64_t kWideFrom = 8;
constexpr int64_t kWideTo = 255;
inline torch::Tensor to_wide(const torch::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1);
  return w.view({n / kWideRows, 2, 8, k}).permute({0, 3, 2, 1}).contiguous().view({n / kWideRows, k, kWideRows});
}

// 8 floats to bf16, rounded to nearest even as at::BFloat16 is (NaN to 0x7FC0).
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

#if defined(__AVX512F__)
// CPUs with AVX-512 but no bf16 arithmetic (Intel Skylake-SP to Ice Lake): the same tiles
// in 512-bit vectors, up to kTileTokens tokens x kTileBlocks 16-row blocks, one accumulator
// of 16 lanes per (token, block). A column's 16 weights of a block (one 32-byte load of the
// pairs layout) widen to one vector whose lanes hold rows 0, 8, 1, 9, ..., 7, 15 (a permute
// puts them in order once, at the store); each x element is one broadcast serving
// kTileBlocks FMAs. Measured on an Ice Lake Xeon (family 6 model 106, 2 vCPUs), one core,
// everything in L1: 8 tokens x 3 blocks 115 GFLOP/s, 12 x 2 98, 6 x 4 83, 16 x 1 64 (fp32
// weights, no widening, peak at ~108 in the same loop). Whole linears: docs/backend.md.
constexpr int kTileTokens = 8;
constexpr int kTileBlocks = 3;

// 16 floats to bf16, rounded as to_bf16() rounds 8.
inline __m256i to_bf16_16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), odd), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// y[0:R, 0:16B] (row stride n) = x[0:R, 0:k] @ W's B blocks from w (pack_wide layout, [k][16]
// each, kWideRows * k apart).
template <int R, int B>
inline void wide_tile(const float* x, int64_t k, const at::BFloat16* w, at::BFloat16* y, int64_t n) {
  __m512 acc[R][B];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < B; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < k; ++t) {
    for (int j = 0; j < B; ++j)
      _mm_prefetch(reinterpret_cast<const char*>(w + j * kWideRows * k + t * kWideRows) + kTileAhead, _MM_HINT_T0);
    __m512 wv[B];
    for (int j = 0; j < B; ++j) {
      const auto* p = reinterpret_cast<const __m256i*>(w + j * kWideRows * k) + t;
      wv[j] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p)), 16));
    }
    for (int i = 0; i < R; ++i) {
      const __m512 s = _mm512_set1_ps(x[t * R + i]);
      for (int j = 0; j < B; ++j) acc[i][j] = _mm512_fmadd_ps(s, wv[j], acc[i][j]);
    }
  }
  const __m512i order = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < B; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * n + j * kWideRows),
                          to_bf16_16(_mm512_permutexvar_ps(order, acc[i][j])));
}

// A tile of `rows` (1..kTileTokens) tokens x `blocks` (1..kTileBlocks) blocks.
template <int R = kTileTokens>
inline void wide_tile_of(int64_t rows, int64_t blocks, const float* x, int64_t k, const at::BFloat16* w,
                         at::BFloat16* y, int64_t n) {
  if constexpr (R > 1)
    if (rows < R) return wide_tile_of<R - 1>(rows, blocks, x, k, w, y, n);
  if (blocks >= 3) return wide_tile<R, 3>(x, k, w, y, n);
  if (blocks == 2) return wide_tile<R, 2>(x, k, w, y, n);
  wide_tile<R, 1>(x, k, w, y, n);
}
#else
constexpr int kTileTokens = 6;
constexpr int kTileBlocks = 1;

// y[0:R, 0:16] (row stride n) = x[0:R, 0:k] @ W's block (pack_wide layout, [k][16]).
// Named accumulators (small_gemm.h: GCC stored an array of them on every step).
template <int R>
inline void wide_tile(const float* x, int64_t k, const at::BFloat16* w, at::BFloat16* y, int64_t n) {
  __m256 x0 = _mm256_setzero_ps(), x1 = x0, x2 = x0, x3 = x0, x4 = x0, x5 = x0;
  __m256 y0 = x0, y1 = x0, y2 = x0, y3 = x0, y4 = x0, y5 = x0;
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const auto* wp = reinterpret_cast<const __m256i*>(w);
  for (int64_t t = 0; t < k; ++t) {
    _mm_prefetch(reinterpret_cast<const char*>(wp + t) + kTileAhead, _MM_HINT_T0);
    const __m256i raw = _mm256_loadu_si256(wp + t);
    const __m256 b0 = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
    const __m256 b1 = _mm256_castsi256_ps(_mm256_and_si256(raw, high));
#define PIE_ROW(r)                                          \
  if constexpr (R > r) {                                    \
    const __m256 s = _mm256_broadcast_ss(x + t * R + r);    \
    x##r = _mm256_fmadd_ps(s, b0, x##r);                    \
    y##r = _mm256_fmadd_ps(s, b1, y##r);                    \
  }
    PIE_ROW(0) PIE_ROW(1) PIE_ROW(2) PIE_ROW(3) PIE_ROW(4) PIE_ROW(5)
#undef PIE_ROW
  }
#define PIE_STORE(r)                                                                         \
  if constexpr (R > r) {                                                                     \
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n), to_bf16(x##r));                  \
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y + r * n + 8), to_bf16(y##r));              \
  }
  PIE_STORE(0) PIE_STORE(1) PIE_STORE(2) PIE_STORE(3) PIE_STORE(4) PIE_STORE(5)
#undef PIE_STORE
}

// A tile of `rows` (1..kTileTokens) tokens x one block.
template <int R = kTileTokens>
inline void wide_tile_of(int64_t rows, int64_t, const float* x, int64_t k, const at::BFloat16* w,
                         at::BFloat16* y, int64_t n) {
  if constexpr (R > 1)
    if (rows < R) return wide_tile_of<R - 1>(rows, 1, x, k, w, y, n);
  wide_tile<R>(x, k, w, y, n);
}
#endif

// The GEMM tiles' tokens: tile i covers rows [first[i], first[i + 1]) of x, at most
// kTileTokens, the tiles as even as they can be.
inline std::vector<int64_t> tile_bounds(int64_t m) {
  const int64_t tiles = (m + kTileTokens - 1) / kTileTokens;
  std::vector<int64_t> first(tiles + 1, 0);
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t left = m - first[i];
    first[i + 1] = first[i] + left / (tiles - i) + (left % (tiles - i) != 0);
  }
  return first;
}

// Rows [r0, r1) of x widened to fp32 and regrouped per tile, column by column ([k][rows] for
// each tile, into xs: m * k floats): a tile's broadcasts then read one stream instead of
// `rows` streams k floats apart.
inline void wide_input(const at::BFloat16* x, int64_t m, int64_t k, float* xs, int64_t r0, int64_t r1) {
  const std::vector<int64_t> first = tile_bounds(m);
  for (size_t i = 0; i + 1 < first.size(); ++i) {
    const int64_t rows = first[i + 1] - first[i];
    float* dst = xs + first[i] * k;
    for (int64_t r = std::max(r0, first[i]) - first[i]; r < rows && first[i] + r < r1; ++r)
      for (int64_t j = 0; j < k; ++j) dst[j * rows + r] = static_cast<float>(x[(first[i] + r) * k + j]);
  }
}

// y's columns of weight blocks [b, e) (16 rows each) for all m tokens, x from wide_input() and
// W from pack_wide(); the tiles of a group of kTileBlocks blocks run one after another, so its W stays near.
inline void wide_blocks(const float* xs, int64_t m, int64_t k, const at::BFloat16* w, int64_t n,
                        int64_t b, int64_t e, at::BFloat16* y) {
  const std::vector<int64_t> first = tile_bounds(m);
  const int64_t tiles = static_cast<int64_t>(first.size()) - 1;
  for (int64_t blk = b; blk < e; blk += kTileBlocks) {
    const int64_t blocks = std::min<int64_t>(kTileBlocks, e - blk);
    const at::BFloat16* wb = w + blk * kWideRows * k;
    at::BFloat16* yb = y + blk * kWideRows;
    for (int64_t i = 0; i < tiles; ++i) {
      const int64_t t = first[i], rows = first[i + 1] - t;
      wide_tile_of(rows, blocks, xs + t * k, k, wb, yb + t * n, n);
    }
  }
}
#define PIE_WIDE 1
#define PIE_WIDE_FP32_INPUT 1  // the tiles read x widened and regrouped (wide_input)
#else
constexpr bool kSupported = false;
constexpr int64_t kPanelRows = 4, kPanelCols = 8;  // pack()'s layout in a build without the loop
inline torch::Tensor to_panels(const torch::Tensor& w) {
  return w.view({w.size(0) / 4, 4, w.size(1) / kPanelCols, kPanelCols}).permute({0, 2, 1, 3});
}
#endif

#if !(defined(__AVX512BF16__) && defined(__AVX512F__)) && !(defined(__AVX2__) && defined(__FMA__))
using XType = at::BFloat16;
constexpr bool kWidens = false;
#endif

}  // namespace

// One call of the kernel, split into its serial and parallel parts so that a caller already
// inside a parallel region (csrc/decode_step.cpp) can share it among its own threads:
// input() for rows [r0, r1) of x (each thread its rows, then a barrier; nothing to do where
// the loop reads x itself), then blocks() for weight-row blocks [b, e) of `blocks` (16 rows
// each). gemv() below is the same two parts under at::parallel_for.
struct GemvCall {
  const at::BFloat16* x;  // [m, k]
  const at::BFloat16* w;  // pack()
  const at::BFloat16* wide;  // pack_wide(), or nullptr: the loop over panels
  int64_t m, k, n;
  at::BFloat16* y;  // [m, n]
  float* xs;  // m * k floats where needs_input(), else unused

  bool tiles() const {
#ifdef PIE_WIDE
    return wide != nullptr && m >= kWideFrom;
#else
    return false;
#endif
  }
  // The AMX tiles (kAmxFrom to kMaxTokens rows, where the process may use AMX).
  bool amx() const {
#ifdef PIE_AMX
    return wide != nullptr && m >= kAmxFrom && m <= kMaxTokens && amx_permitted();
#else
    return false;
#endif
  }
  bool needs_input() const {
#ifdef PIE_WIDE_FP32_INPUT
    if (tiles()) return true;
#endif
    return kWidens;
  }
  int64_t blocks() const { return blocks_of(n); }
  // Blocks a thread of csrc/decode_step.cpp's region claims at a time: 2, or a whole tile's
  // where a tile spans 3 (AVX-512 without BF16: with claims of 2 every tile was 8 tokens x 2
  // blocks). A decode step there (Ice Lake Xeon, family 6 model 106, 2 vCPUs, context 128,
  // claims of 2 and 3 alternating step by step in one process, two runs): 0.99-1.02x the
  // time at batch 1, 0.93x at 8, 0.93x at 16, 0.94-0.96x at 32; the same bits.
#ifdef PIE_WIDE_FP32_INPUT
  static constexpr int64_t kClaimBlocks = kTileBlocks > 2 ? kTileBlocks : 2;
#else
  static constexpr int64_t kClaimBlocks = 2;
#endif
  static int64_t blocks_of(int64_t n) { return (n + kBlockRows - 1) / kBlockRows; }

  void input(int64_t r0, int64_t r1) const {
#ifdef PIE_WIDE_FP32_INPUT
    if (tiles()) return wide_input(x, m, k, xs, r0, r1);
#endif
    if constexpr (kWidens)
      for (int64_t i = r0 * k; i < r1 * k; ++i) xs[i] = static_cast<float>(x[i]);
  }

  void blocks(int64_t b, int64_t e) const {
#ifdef PIE_WIDE_FP32_INPUT
    if (tiles()) return wide_blocks(xs, m, k, wide, n, b, e, y);
#elif defined(PIE_WIDE)
#ifdef PIE_AMX
    if (amx()) return amx_blocks(x, m, k, wide, n, b, e, y);
#endif
    if (tiles()) return wide_blocks(x, m, k, wide, n, b, e, y);
#endif
#if (defined(__AVX512BF16__) && defined(__AVX512F__)) || (defined(__AVX2__) && defined(__FMA__))
    const XType* xp;
    if constexpr (kWidens) xp = reinterpret_cast<const XType*>(xs); else xp = reinterpret_cast<const XType*>(x);
    // Every pass of kPassTokens tokens over one block before the next, so a call of 17-32
    // tokens reads a block from memory once and again from L1/L2 (see kBlockRows).
    for (int64_t blk = b; blk < e; ++blk) {
      const int64_t lo = blk * kBlockRows, hi = std::min(n, lo + kBlockRows);
      for (int64_t t = 0; t < m; t += kPassTokens) {
        const auto* x0 = xp + t * k;
        auto* y0 = y + t * n;
        switch (std::min(kPassTokens, m - t)) {
          case 1: rows<1>(x0, w, k, n, lo, hi, y0); break;
          case 2: rows<2>(x0, w, k, n, lo, hi, y0); break;
          case 3: rows<3>(x0, w, k, n, lo, hi, y0); break;
          case 4: rows<4>(x0, w, k, n, lo, hi, y0); break;
          case 5: rows<5>(x0, w, k, n, lo, hi, y0); break;
          case 6: rows<6>(x0, w, k, n, lo, hi, y0); break;
          case 7: rows<7>(x0, w, k, n, lo, hi, y0); break;
          case 8: rows<8>(x0, w, k, n, lo, hi, y0); break;
          case 9: rows<9>(x0, w, k, n, lo, hi, y0); break;
          case 10: rows<10>(x0, w, k, n, lo, hi, y0); break;
          case 11: rows<11>(x0, w, k, n, lo, hi, y0); break;
          case 12: rows<12>(x0, w, k, n, lo, hi, y0); break;
          case 13: rows<13>(x0, w, k, n, lo, hi, y0); break;
          case 14: rows<14>(x0, w, k, n, lo, hi, y0); break;
          case 15: rows<15>(x0, w, k, n, lo, hi, y0); break;
          default: rows<16>(x0, w, k, n, lo, hi, y0); break;
        }
      }
    }
#endif
  }
};

bool supported() { return kSupported; }

bool native_bf16() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

int64_t max_tokens() { return kMaxTokens; }

// From how many rows gemv() runs on AMX tiles (0: never: no AMX in this build, or the OS
// refused the process its tile state).
int64_t amx_from() {
#ifdef PIE_AMX
  return amx_permitted() ? kAmxFrom : 0;
#else
  return 0;
#endif
}

static_assert(kBlockRows % kPanelRows == 0, "a thread's blocks start on a panel");

int64_t panel_rows() { return kPanelRows; }

int64_t panel_cols() { return kPanelCols; }

// The weight as gemv() reads it: a copy in 4-row panels, [n/4, k/C, 4, C] with C =
// panel_cols() (32 with AVX-512 BF16, 8 with AVX2), so nothing mistakes it for an [n, k]
// matrix.
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "bf16_gemv: weight must be a contiguous bfloat16 [n, k] matrix");
  TORCH_CHECK(weight.size(1) % 32 == 0, "bf16_gemv: k = ", weight.size(1), " is not a multiple of 32");
  TORCH_CHECK(weight.size(0) % kPanelRows == 0, "bf16_gemv: n = ", weight.size(0),
              " is not a multiple of ", kPanelRows, " (the rows of this build's weight panels)");
  return to_panels(weight).contiguous();
}

// pack() into `out` (contiguous bfloat16 of pack()'s shape, e.g. a slot of the model's
// weight arena), with no copy between; returns `out`.
torch::Tensor pack_into(torch::Tensor weight, torch::Tensor out) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 &&
                  weight.size(1) % 32 == 0 && weight.size(0) % kPanelRows == 0,
              "bf16_gemv: weight must be a contiguous bfloat16 [n, k] matrix that pack() takes");
  const auto panels = to_panels(weight);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.sizes() == panels.sizes(),
              "bf16_gemv: out must be contiguous bfloat16 of shape ", panels.sizes());
  return out.copy_(panels);
}

std::vector<int64_t> packed_shape(int64_t n, int64_t k) {
  return {n / kPanelRows, k / kPanelCols, kPanelRows, kPanelCols};
}

// The weight in the layout of the GEMM tiles for kWideFrom+ tokens and of the AMX tiles
// ([n/16, k, 16], see wide_tile); an empty tensor where this build has neither or n is no
// multiple of 16, and gemv() then keeps its own loop at every size.
torch::Tensor pack_wide(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.scalar_type() == at::kBFloat16,
              "bf16_gemv: weight must be a contiguous bfloat16 [n, k] matrix");
#ifdef PIE_WIDE
  if (weight.size(0) % kWideRows == 0) return to_wide(weight);
#endif
  return torch::empty({0}, weight.options());
}

int64_t wide_from() {
#ifdef PIE_WIDE
  return kWideFrom;
#else
  return 0;
#endif
}

int64_t wide_to() {
#ifdef PIE_WIDE
  return kWideTo;
#else
  return 0;
#endif
}

// weight: from pack(); wide: from pack_wide() (or empty: none).
torch::Tensor gemv(torch::Tensor x, torch::Tensor weight, torch::Tensor wide) {
  TORCH_CHECK(kSupported, "bf16_gemv: compiled without AVX-512 BF16 or AVX2 + FMA (check supported() first)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "bf16_gemv: x must be a contiguous bfloat16 [m, k] matrix");
  TORCH_CHECK(weight.is_contiguous() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 &&
                  weight.size(2) == kPanelRows && weight.size(3) == kPanelCols,
              "bf16_gemv: weight must be a contiguous bfloat16 [n/4, k/", kPanelCols, ", 4, ", kPanelCols,
              "] tensor from pack()");
  const int64_t m = x.size(0), k = x.size(1);
  const int64_t n = weight.size(0) * kPanelRows, wk = weight.size(1) * kPanelCols;
  TORCH_CHECK(wk == k, "bf16_gemv: x has ", k, " columns, weight ", wk);
  TORCH_CHECK(k % 32 == 0, "bf16_gemv: k = ", k, " is not a multiple of 32");
  // With a wide weight (AVX2) the GEMM tiles take up to wide_to() rows.
  TORCH_CHECK(m >= 1 && (m <= kMaxTokens || (wide.numel() > 0 && m <= wide_to())), "bf16_gemv: ", m,
              " rows (1..", kMaxTokens, ", or 1..", wide_to(), " with a wide weight from pack_wide())");
  // The wide weight for the GEMM tiles' rows, and for the AMX tiles' (from amx_from()).
  const bool tiles = wide.numel() > 0 && ((m >= wide_from() && wide_from() > 0) ||
                                          (amx_from() > 0 && m >= amx_from() && m <= kMaxTokens));
  if (tiles)
    TORCH_CHECK(wide.is_contiguous() && wide.scalar_type() == at::kBFloat16 && wide.dim() == 3 &&
                    wide.size(0) * 16 == n && wide.size(1) == k && wide.size(2) == 16,
                "bf16_gemv: wide must be pack_wide() of the same weight, [n/16, k, 16]");
  auto y = torch::empty({m, n}, x.options());
  const GemvCall call{x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                      tiles ? wide.data_ptr<at::BFloat16>() : nullptr, m, k, n, y.data_ptr<at::BFloat16>(), nullptr};
  std::vector<float> xs(call.needs_input() ? m * k : 0);
  GemvCall with_input = call;
  with_input.xs = xs.data();
  with_input.input(0, m);
  // Each thread takes a contiguous run of blocks (at::parallel_for gives the threads equal
  // shares of the block range).
  at::parallel_for(0, with_input.blocks(), 1, [&](int64_t b, int64_t e) { with_input.blocks(b, e); });
  return y;
}

#ifndef PIE_NO_BINDINGS  // csrc/decode_step.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this build has the kernel (AVX-512 BF16, or AVX2 + FMA)");
  m.def("native_bf16", &native_bf16, "whether it multiplies bf16 in hardware (AVX-512 BF16)");
  m.def("max_tokens", &max_tokens, "the most rows of x one call takes");
  m.def("amx_from", &amx_from, "from how many rows of x gemv() runs AMX tiles, up to max_tokens() (0: never)");
  m.def("panel_rows", &panel_rows, "the rows of pack()'s panels (pack() takes multiples of it)");
  m.def("panel_cols", &panel_cols, "the columns of one row in a step of pack()'s panels");
  m.def("pack", &pack, "the weight in the layout gemv() reads");
  m.def("pack_into", &pack_into, "pack() into a given tensor of packed_shape()");
  m.def("packed_shape", &packed_shape, "the shape pack() gives an [n, k] weight");
  m.def("pack_wide", &pack_wide, "the weight in the layout of the GEMM tiles (empty: none in this build)");
  m.def("wide_from", &wide_from, "from how many rows of x gemv() uses pack_wide()'s weight (0: never)");
  m.def("wide_to", &wide_to, "up to how many rows of x gemv() takes with pack_wide()'s weight (0: none)");
  m.def("gemv", &gemv, "y = x @ weight.T in bf16 for 1..max_tokens() rows of x; weight from pack(), "
        "wide from pack_wide() (or empty)");
}
#endif
