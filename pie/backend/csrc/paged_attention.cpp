// Paged attention for CPU: each new token attends straight to its item's slots in the KV pools
// (no gather copy), in fp32, the query heads of a KV head sharing every key load.
// Pools (pie/backend/kv_cache.py): keys [pages, kv_heads, dim, page_size] (transposed within a
// page), values [pages, kv_heads, page_size, dim]; slot = page * page_size + offset.
// A run of keys filling one whole page is scored page_size lanes at a time with no horizontal
// sums, up to four heads of a group per load of the page; other keys (a partial last page,
// scratch slots) take a scalar path. Accumulators are vector values (GCC/Clang vector
// extensions) so they stay in registers: at batch 32, context 512 (bf16) this took a
// decode step's attention from ~57 to ~38 ms (timed around `attention.run` in-process,
// old and new builds alternating; benchmarks/backend.py has the step). Software prefetch of
// the next key page and of value rows 16 keys ahead (now further: kKeyPagesAhead), and page
// sizes known at compile time in the value pass: 44.7 -> 31.8 ms on the Xeon of 2026-11-26
// (2 vCPUs; the pages of 32 sequences are scattered, so the hardware prefetcher loses each
// stream at a page's end).
// A partly filled last page is scored whole and vectorised (not key by key with strided
// loads): 128 decode items' attention per step 23.6 -> 12.8 ms at 16 keys, 34.9 -> 22.2 ms
// at 64 (Xeon with AMX, 2026-11-28, in-process, one-off).
// Visibility follows pie/backend/attention.py: page mask bits, then the item's custom mask or
// the causal rule (key j visible to new token i iff j < n_context + i + 1).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "fast_exp.h"
#include "prompt_attention.h"
#include "shared_prefix.h"

namespace {

inline float load(const float* p) { return *p; }
inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[0]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// GCC/Clang vector extensions: N floats as one value, so accumulators stay in registers
// (AVX-512 or AVX2 code, whatever -march=native allows) instead of round-tripping through a
// stack array per step, which left the old loops bound by store-to-load latency.
// (Typedefs inside a class template: GCC ignores vector_size on an alias template.)
template <int N> struct Lanes {
  typedef float f __attribute__((vector_size(N * sizeof(float))));
  typedef uint16_t u16 __attribute__((vector_size(N * sizeof(uint16_t))));
  typedef uint32_t u32 __attribute__((vector_size(N * sizeof(uint32_t))));
};
template <int N> using vfloat = typename Lanes<N>::f;
template <int N> using vu16 = typename Lanes<N>::u16;
template <int N> using vu32 = typename Lanes<N>::u32;

template <int N> inline vfloat<N> load_vec(const float* p) {
  vfloat<N> v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
template <int N> inline vfloat<N> load_vec(const at::BFloat16* p) {
#ifdef __AVX512F__
  if constexpr (N == 16) {  // GCC built the generic form below from two 8-lane halves and a shuffle
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
    vfloat<N> v;
    std::memcpy(&v, &bits, sizeof v);
    return v;
  }
#endif
  vu16<N> half;
  std::memcpy(&half, p, sizeof half);
  const vu32<N> bits = __builtin_convertvector(half, vu32<N>) << 16;
  vfloat<N> v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Floats per vector register. AVX2 has 16 of them (ymm, 8 floats): accumulators of 16 lanes
// take two each, and a value pass's 3 heads x 64 dims alone needed 24, so they spilled and
// every FMA waited on a store-to-load round trip. The loops below work in register-wide
// column blocks instead; each output still sums its terms in the same order, so results are
// bit-identical. On an AMD EPYC (AVX2, 2 vCPUs; bf16 pools, 30 layers' attention in-process,
// old and new builds one after the other) a batch-32 decode step's took 47.2 -> 28.8 ms at
// context 128 and 176.5 -> 102.9 ms at context 512; batch 8 at 128: 12.2 -> 7.6 ms.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif

// How far ahead the passes prefetch: the key pass the page 3 pages on (one line per two dims
// as it scores a page), the value pass the row 32 keys on. One page / 16 keys covered less
// than a DRAM miss's latency: with these and the AVX-512 load below, a batch-32 step's
// attention at context 512 (30 layers, bf16, pages scattered) took 21.4 -> 14.9 ms on an AMD
// EPYC Zen 5 (2 vCPUs, 2026-12-07; both builds in one process, alternating), 17.6 -> 25.4
// GB/s of KV against the ~43 GB/s a plain read gets there. Prefetching to L2 further ahead
// as well, or values during the key pass, measured the same.
constexpr int64_t kKeyPagesAhead = 3, kValueKeysAhead = 32;

struct Shape {
  int64_t heads, kv_heads, group, dim, page_size;
};

// slot -> (page, offset); a compile-time page size turns the divisions into shifts (two
// runtime int64 divisions per key cost more than its 12 value FMAs at dim 64, group 3).
template <int PS>
inline int64_t page_of(int64_t slot, int64_t page_size) {
  if constexpr (PS > 0) return slot / PS; else return slot / page_size;
}
template <int PS>
inline int64_t offset_of(int64_t slot, int64_t page_size) {
  if constexpr (PS > 0) return slot % PS; else return slot % page_size;
}

// A KV head's keys of the page holding `slot` ([dim][page_size]), and the value row of `slot`.
template <int PS, typename T>
inline const T* key_page(const T* k_pool, int64_t slot, int64_t h, const Shape& s) {
  return k_pool + (page_of<PS>(slot, s.page_size) * s.kv_heads + h) * s.dim * s.page_size;
}
template <int PS, typename T>
inline const T* value_row(const T* v_pool, int64_t slot, int64_t h, const Shape& s) {
  return v_pool + (page_of<PS>(slot, s.page_size) * s.kv_heads + h) * s.page_size * s.dim +
         offset_of<PS>(slot, s.page_size) * s.dim;
}

// Scores of G heads of one query against one whole page of keys ([dim][PS] in the pool): the
// page's key rows are loaded once for the G heads, two dims at a time into independent
// accumulators (2G FMA chains in flight). `ahead`: a page to prefetch meanwhile, a line or
// two per step (32 prefetches at once, at the page's start, overflowed the core's miss
// buffers and stalled the loads behind them).
template <typename T, int PS, int G>
inline void score_page(const float* q, const T* page, int64_t dim, float scale, const bool* seen,
                       float* scores, int64_t n_k, const char* ahead = nullptr) {
  constexpr int L = PS < kLanes ? PS : kLanes;  // keys per block (PS is a multiple of it)
  constexpr int64_t step_bytes = 2 * PS * int64_t(sizeof(T));  // a page's bytes per d step
  for (int c = 0; c < PS; c += L) {
    vfloat<L> acc[G][2] = {};
    int64_t d = 0;
    for (; d + 1 < dim; d += 2) {
      if (ahead && c == 0)
        for (int64_t line = 0; line < step_bytes; line += 64) __builtin_prefetch(ahead + d * PS * sizeof(T) + line, 0, 3);
      const vfloat<L> k0 = load_vec<L>(page + d * PS + c), k1 = load_vec<L>(page + (d + 1) * PS + c);
      for (int g = 0; g < G; ++g) {
        acc[g][0] += q[g * dim + d] * k0;
        acc[g][1] += q[g * dim + d + 1] * k1;
      }
    }
    if (d < dim) {
      const vfloat<L> k0 = load_vec<L>(page + d * PS + c);
      for (int g = 0; g < G; ++g) acc[g][0] += q[g * dim + d] * k0;
    }
    for (int g = 0; g < G; ++g) {
      const vfloat<L> sum = (acc[g][0] + acc[g][1]) * scale;
      for (int l = 0; l < L; ++l) scores[g * n_k + c + l] = seen[c + l] ? sum[l] : -INFINITY;
    }
  }
}

// Scores of one query's `group` heads against keys [0, limit) of one item and KV head `h`.
template <typename T, int PS>
void score(const float* q, const T* k_pool, const int64_t* slots, const bool* seen,
           int64_t limit, int64_t h, const Shape& s, float scale, float* scores, int64_t n_k) {
  int64_t j = 0;
  while (j < limit) {
    const int64_t slot = slots[j];
    const bool whole_page = PS > 0 && slot % PS == 0 && j + PS <= limit && slots[j + PS - 1] == slot + PS - 1;
    const T* base = key_page<PS>(k_pool, slot, h, s);
    if constexpr (PS > 0) {
      if (whole_page) {
        const char* next = nullptr;  // the keys kKeyPagesAhead pages on, while this one is scored
        if (j + kKeyPagesAhead * PS < limit)
          next = reinterpret_cast<const char*>(key_page<PS>(k_pool, slots[j + kKeyPagesAhead * PS], h, s));
        for (int64_t g = 0; g < s.group; g += 4) {
          const float* qg = q + g * s.dim;
          float* out = scores + g * n_k + j;
          const char* ahead = g == 0 ? next : nullptr;
          switch (std::min<int64_t>(4, s.group - g)) {
            case 1: score_page<T, PS, 1>(qg, base, s.dim, scale, seen + j, out, n_k, ahead); break;
            case 2: score_page<T, PS, 2>(qg, base, s.dim, scale, seen + j, out, n_k, ahead); break;
            case 3: score_page<T, PS, 3>(qg, base, s.dim, scale, seen + j, out, n_k, ahead); break;
            default: score_page<T, PS, 4>(qg, base, s.dim, scale, seen + j, out, n_k, ahead); break;
          }
        }
        j += PS;
        continue;
      }
      const int64_t rest = limit - j;
      if (slot % PS == 0 && rest < PS && slots[j + rest - 1] == slot + rest - 1) {
        // The last, partly filled page (every decode item has one): scored whole, vectorised,
        // into a scratch row per head, keeping its first `rest` lanes (the others hold
        // whatever the pool has there). The scalar loop below, with its strided loads,
        // cost ~2 us per item and KV head: ~23 ms of a 128-item step at 16 keys.
        float part[4 * PS];
        bool all[PS];
        std::fill(all, all + PS, true);
        for (int64_t g = 0; g < s.group; g += 4) {
          const int64_t heads = std::min<int64_t>(4, s.group - g);
          const float* qg = q + g * s.dim;
          switch (heads) {
            case 1: score_page<T, PS, 1>(qg, base, s.dim, scale, all, part, PS); break;
            case 2: score_page<T, PS, 2>(qg, base, s.dim, scale, all, part, PS); break;
            case 3: score_page<T, PS, 3>(qg, base, s.dim, scale, all, part, PS); break;
            default: score_page<T, PS, 4>(qg, base, s.dim, scale, all, part, PS); break;
          }
          for (int64_t gg = 0; gg < heads; ++gg)
            for (int64_t l = 0; l < rest; ++l)
              scores[(g + gg) * n_k + j + l] = seen[j + l] ? part[gg * PS + l] : -INFINITY;
        }
        j = limit;
        continue;
      }
    }
    {
      // Summed in score_page's order (even and odd dims apart, then together), so a key
      // scores the same bits whichever path its slot's alignment sends it down: a pass
      // gives the same result alone or beside others (tests/test_scoring.py).
      const int64_t offset = slot % s.page_size;
      for (int64_t g = 0; g < s.group; ++g) {
        float even = 0.f, odd = 0.f;
        const float* qg = q + g * s.dim;
        int64_t d = 0;
        for (; d + 1 < s.dim; d += 2) {
          even += qg[d] * load(base + d * s.page_size + offset);
          odd += qg[d + 1] * load(base + (d + 1) * s.page_size + offset);
        }
        if (d < s.dim) even += qg[d] * load(base + d * s.page_size + offset);
        scores[g * n_k + j] = seen[j] ? (even + odd) * scale : -INFINITY;
      }
      ++j;
    }
  }
}

// acc[G][D] += p[g][j] * v[j] over the visible keys j of one item and KV head `h`: each value
// row is loaded (and widened) once for the G heads; the G x D accumulators stay in registers.
template <typename T, int PS, int D, int G>
inline void accumulate_values(const T* v_pool, const int64_t* slots, const char* seen, int64_t limit,
                              int64_t h, const Shape& s, const float* p, int64_t n_k, float* out,
                              const char* const* lines, int64_t n_lines) {
  // Columns per pass over the keys: all D with AVX-512's 32 registers; 32 with AVX2's 16
  // (G x 4 accumulators + 4 row vectors), the later passes reading rows the first left in
  // cache. Vectors of one register each (W = kLanes): with 16-float vectors on AVX2, GCC
  // lowered every operation on them through the stack; in 8-float ones a batch-32 decode
  // step's attention (30 layers, bf16, AMD EPYC, 2 vCPUs) took 31.0 -> 18.0 ms at 128 keys
  // and 97.6 -> 55.2 ms at 512, bit-identical (same terms, same order).
  constexpr int W = kLanes, C = kLanes == 16 ? D : 32, V = C / W;
  for (int c0 = 0; c0 < D; c0 += C) {
    vfloat<W> acc[G][V] = {};
    constexpr int64_t ahead = kValueKeysAhead;
    for (int64_t j = 0; j < limit; ++j) {
      if (c0 == 0 && j < n_lines) __builtin_prefetch(lines[j], 0, 3);
      if (c0 == 0 && j + ahead < limit) {
        const char* row = reinterpret_cast<const char*>(value_row<PS>(v_pool, slots[j + ahead], h, s));
        for (int64_t line = 0; line < D * int64_t(sizeof(T)); line += 64) __builtin_prefetch(row + line, 0, 3);
      }
      if (!seen[j]) continue;
      const T* v_row = value_row<PS>(v_pool, slots[j], h, s) + c0;
      vfloat<W> v[V];
      for (int c = 0; c < V; ++c) v[c] = load_vec<W>(v_row + c * W);
      for (int g = 0; g < G; ++g) {
        const float pj = p[g * n_k + j];
        for (int c = 0; c < V; ++c) acc[g][c] += pj * v[c];
      }
    }
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < V; ++c) std::memcpy(out + g * D + c0 + c * W, &acc[g][c], sizeof acc[g][c]);
  }
  for (int64_t j = limit; j < n_lines; ++j) __builtin_prefetch(lines[j], 0, 3);
}

// The (item, KV head) units (u = item * kv_heads + h) dealt to n_threads threads by cost (new
// tokens x keys), heaviest first to the least loaded: at::parallel_for's equal runs of units
// gave one thread the prompts of a batch that mixes 32 decoders with 4 prompts of 128 tokens,
// and that batch's step took 2,107 ms against 2,051 with the prompts on SDPA (AMD EPYC, 2
// vCPUs; attention.py). Disabled items are dealt to no one.
inline std::vector<std::vector<int64_t>> deal_units(const int64_t* q_indptr, const int64_t* kv_indptr,
                                                    const bool* enabled, const shared_prefix::ItemPart* prefix,
                                                    int64_t n_items, int64_t kv_heads, int64_t n_threads) {
  const int64_t units = n_items * kv_heads;
  std::vector<std::pair<int64_t, int64_t>> by_cost;  // (cost, unit)
  by_cost.reserve(units);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t b = u / kv_heads;
    if (enabled[b])
      by_cost.emplace_back((q_indptr[b + 1] - q_indptr[b]) * (kv_indptr[b + 1] - kv_indptr[b] - prefix[b].keys + 1), u);
  }
  std::stable_sort(by_cost.begin(), by_cost.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<std::vector<int64_t>> share(n_threads);
  std::vector<int64_t> busy(n_threads, 0);
  for (const auto& [cost, u] : by_cost) {
    const int64_t t = std::min_element(busy.begin(), busy.end()) - busy.begin();
    share[t].push_back(u);
    busy[t] += cost;
  }
  return share;
}

// A forward's attention inputs (one layer's pools) and a thread's scratch.
template <typename T>
struct Attention {
  const float* q;  // [tokens, heads, dim]
  const T* k_pool;
  const T* v_pool;
  float* out;  // [tokens, heads, dim]
  const int64_t *q_indptr, *kv_indptr, *slots;
  const bool* visible;
  const int64_t* mask_offsets;
  const bool* masks;
  const shared_prefix::ItemPart* prefix;
  Shape s;
  float scale;
};

struct UnitScratch {
  std::vector<float> scores, acc, top, total;
  std::vector<char> seen;
  std::vector<const char*> next_lines;  // the next unit's first key pages and value rows
  explicit UnitScratch(const Shape& s) : acc(s.group * s.dim), top(s.group), total(s.group) {}
};

// Appends to `lines` the cache lines a unit reads before its own prefetches run ahead: its
// first kKeyPagesAhead key pages and kValueKeysAhead value rows. The unit before it on the
// same thread prefetches them during its value pass, a line per key. Without that each unit began
// with a run of DRAM misses, which short units felt most: a batch-32 step's attention (30
// layers, bf16, pages scattered; AMD EPYC Zen 5, 2026-12-07, builds alternating in one
// process) 4.98 -> 4.05 ms at 128 keys, 16.6 -> 15.7 at 512; with the prefetch distances
// above as well, against the build before both, 2.44 -> 1.80 ms at 40 keys and batch 8 at
// 200 keys 2.10 -> 1.33.
template <typename T, int PS>
void list_first_lines(const Attention<T>& a, int64_t work, std::vector<const char*>& lines) {
  const Shape& s = a.s;
  const int64_t b = work / s.kv_heads, h = work % s.kv_heads;
  const int64_t k0 = a.kv_indptr[b] + a.prefix[b].keys, n_k = a.kv_indptr[b + 1] - k0;
  const int64_t page_bytes = s.dim * PS * int64_t(sizeof(T)), row_bytes = s.dim * int64_t(sizeof(T));
  for (int64_t j = 0; j < std::min<int64_t>(n_k, kKeyPagesAhead * PS); j += PS) {
    const char* page = reinterpret_cast<const char*>(key_page<PS>(a.k_pool, a.slots[k0 + j], h, s));
    for (int64_t line = 0; line < page_bytes; line += 64) lines.push_back(page + line);
  }
  for (int64_t j = 0; j < std::min<int64_t>(n_k, kValueKeysAhead); ++j) {
    const char* row = reinterpret_cast<const char*>(value_row<PS>(a.v_pool, a.slots[k0 + j], h, s));
    for (int64_t line = 0; line < row_bytes; line += 64) lines.push_back(row + line);
  }
}

// One unit's new tokens of one item against its keys, for the `group` query heads of KV head h.
// `next`: the unit this thread takes after it (-1: none), whose first lines it prefetches.
template <typename T, int PS>
void attend_unit(const Attention<T>& a, int64_t work, int64_t next, UnitScratch& scratch) {
  const Shape& s = a.s;
  const float* q = a.q;
  const float scale = a.scale;
  const T *k_pool = a.k_pool, *v_pool = a.v_pool;
  float* out = a.out;
  const int64_t *q_indptr = a.q_indptr, *kv_indptr = a.kv_indptr, *slots = a.slots, *mask_offsets = a.mask_offsets;
  const bool *visible = a.visible, *masks = a.masks;
  const shared_prefix::ItemPart* prefix = a.prefix;
  std::vector<float>& scores = scratch.scores;
  std::vector<float>& acc = scratch.acc;
  std::vector<float>& top = scratch.top;
  std::vector<float>& total = scratch.total;
  std::vector<char>& seen = scratch.seen;
  const int64_t b = work / s.kv_heads, h = work % s.kv_heads;  // (disabled items were never dealt)
  // An item in a shared-prefix group attends here to its keys after the prefix only.
  const shared_prefix::ItemPart& part = prefix[b];
  const int64_t q0 = q_indptr[b], n_q = q_indptr[b + 1] - q0;
  const int64_t k0 = kv_indptr[b] + part.keys, n_k = kv_indptr[b + 1] - k0;
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
      const float* row = scores.data() + g * n_k;
      // Not std::max: GCC leaves that reduction scalar, a 4-cycle chain per key (~0.5 ms
      // of a 2.5 ms layer at 32 items x 2,048 keys); this form it vectorises.
#pragma omp simd reduction(max : m)
      for (int64_t j = 0; j < limit; ++j) m = row[j] > m ? row[j] : m;
      float sum = 0.f;
      float* sg = scores.data() + g * n_k;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < limit; ++j) {  // unseen keys score -inf: e^-inf = 0
        const float p = m == -INFINITY ? 0.f : exp_nonpositive(sg[j] - m);
        sg[j] = p;
        sum += p;
      }
      top[g] = m;
      total[g] = sum;
    }
    std::fill(acc.begin(), acc.end(), 0.f);
    scratch.next_lines.clear();
    if constexpr (PS > 0)
      if (next >= 0 && i == n_q - 1 && (s.dim == 64 || s.dim == 128))  // (accumulate_values issues them)
        list_first_lines<T, PS>(a, next, scratch.next_lines);
    for (int64_t g = 0; g < s.group; g += 4) {
      const int64_t heads = std::min<int64_t>(4, s.group - g);
      float* a = acc.data() + g * s.dim;
      const float* p = scores.data() + g * n_k;
      const bool fast = s.dim == 64 || s.dim == 128;
#define PIE_VALUES(D, G) accumulate_values<T, PS, D, G>(v_pool, slots + k0, seen.data(), limit, h, s, p, n_k, a, \
                                                       scratch.next_lines.data(), g == 0 ? int64_t(scratch.next_lines.size()) : 0)
      if (fast && s.dim == 64) {
        switch (heads) { case 1: PIE_VALUES(64, 1); break; case 2: PIE_VALUES(64, 2); break;
                         case 3: PIE_VALUES(64, 3); break; default: PIE_VALUES(64, 4); }
      } else if (fast) {
        switch (heads) { case 1: PIE_VALUES(128, 1); break; case 2: PIE_VALUES(128, 2); break;
                         case 3: PIE_VALUES(128, 3); break; default: PIE_VALUES(128, 4); }
      } else {
        for (int64_t j = 0; j < limit; ++j) {
          if (!seen[j]) continue;
          const int64_t slot = slots[k0 + j];
          const T* v_row = value_row<PS>(v_pool, slot, h, s);
          for (int64_t gg = 0; gg < heads; ++gg) {
            const float pj = p[gg * n_k + j];
#pragma omp simd
            for (int64_t d = 0; d < s.dim; ++d) a[gg * s.dim + d] += pj * load(v_row + d);
          }
        }
      }
#undef PIE_VALUES
    }
    for (int64_t g = 0; g < s.group; ++g) {
      float* o = out + ((q0 + i) * s.heads + h * s.group + g) * s.dim;
      const float* a = acc.data() + g * s.dim;
      if (part.keys == 0) {
        const float inv = 1.f / total[g];
        for (int64_t d = 0; d < s.dim; ++d) o[d] = a[d] * inv;
        continue;
      }
      // Merge the two softmax parts (both have a visible key, so both maxima are finite).
      const int64_t row = h * part.rows + part.row + g;
      const float m = std::max(top[g], part.top[row]);
      const float own = std::exp(top[g] - m), shared = std::exp(part.top[row] - m);
      const float inv = 1.f / (total[g] * own + part.total[row] * shared);
      const float* pa = part.acc + row * s.dim;
      for (int64_t d = 0; d < s.dim; ++d) o[d] = (a[d] * own + pa[d] * shared) * inv;
    }
  }
}

template <typename T, int PS>
void attend(const Attention<T>& a, const bool* enabled, int64_t n_items) {
  const int64_t units = n_items * a.s.kv_heads;
  const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  const auto share = deal_units(a.q_indptr, a.kv_indptr, enabled, a.prefix, n_items, a.s.kv_heads, n_threads);
  at::parallel_for(0, n_threads, 1, [&](int64_t begin, int64_t end) {
    UnitScratch scratch(a.s);
    for (int64_t t = begin; t < end; ++t)
      for (size_t i = 0; i < share[t].size(); ++i)
        attend_unit<T, PS>(a, share[t][i], i + 1 < share[t].size() ? share[t][i + 1] : -1, scratch);
  });
}

// One token's keys and values ([kv_heads, dim] each, the pools' dtype) to `slot` of the pools.
template <typename T>
inline void write_kv_row(T* k_pool, T* v_pool, int64_t slot, const T* k, const T* v, int64_t kv_heads,
                         int64_t dim, int64_t page_size) {
  const int64_t page = slot / page_size, offset = slot % page_size;
  for (int64_t h = 0; h < kv_heads; ++h) {
    const T* k_row = k + h * dim;
    T* k_dst = k_pool + (page * kv_heads + h) * dim * page_size + offset;
    for (int64_t d = 0; d < dim; ++d) k_dst[d * page_size] = k_row[d];
    std::memcpy(v_pool + ((page * kv_heads + h) * page_size + offset) * dim, v + h * dim, dim * sizeof(T));
  }
}

}  // namespace

// q: [T, heads, dim] fp32; pools as above (fp32 or bf16); returns fp32 [T, heads, dim].
// Items whose `enabled` flag is false are left for the caller (their output rows are zero).
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                              torch::Tensor q_indptr, torch::Tensor kv_indptr, torch::Tensor slots,
                              torch::Tensor visible, torch::Tensor mask_offsets, torch::Tensor masks,
                              torch::Tensor enabled, torch::Tensor groups, torch::Tensor scratch,
                              double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 3);
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 4);
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type());
  const Shape s{q.size(1), k_pool.size(1), q.size(1) / k_pool.size(1), q.size(2), k_pool.size(3)};
  TORCH_CHECK(s.heads % s.kv_heads == 0 && k_pool.size(2) == s.dim && v_pool.size(3) == s.dim);
  auto out = torch::zeros_like(q);
  const int64_t n_items = q_indptr.size(0) - 1;
  std::vector<shared_prefix::ItemPart> prefix(n_items);
  const auto parts = shared_prefix::attend_prefixes(q, k_pool, v_pool, q_indptr.data_ptr<int64_t>(),
                                                    groups, scratch, scale, prefix);
  const auto call = [&](auto* k, auto* v, auto page_size) {
    constexpr int PS = decltype(page_size)::value;
    using T = std::remove_const_t<std::remove_pointer_t<decltype(k)>>;
    const Attention<T> a{q.data_ptr<float>(), k, v, out.data_ptr<float>(), q_indptr.data_ptr<int64_t>(),
                         kv_indptr.data_ptr<int64_t>(), slots.data_ptr<int64_t>(), visible.data_ptr<bool>(),
                         mask_offsets.data_ptr<int64_t>(), masks.data_ptr<bool>(), prefix.data(), s,
                         static_cast<float>(scale)};
    attend<T, PS>(a, enabled.data_ptr<bool>(), n_items);
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
      write_kv_row(kp, vp, slot[i], ks + i * kv_heads * dim, vs + i * kv_heads * dim, kv_heads, dim, ps);
    }
  };
  if (k_pool.scalar_type() == at::kBFloat16)
    copy(k_pool.data_ptr<at::BFloat16>(), v_pool.data_ptr<at::BFloat16>(), k.data_ptr<at::BFloat16>(),
         v.data_ptr<at::BFloat16>());
  else
    copy(k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>());
}

#ifndef PIE_NO_BINDINGS  // csrc/decode_step.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "paged attention over the KV page pools (CPU)");
  m.def("write_kv", &write_kv, "write new keys and values to their slots in the pools (CPU)");
  m.def("prompt_attention", &prompt_attention::attend, "causal attention of one prompt item in bf16 dot products (CPU, AVX-512 BF16)");
  m.def("prompt_attention_dense", &prompt_attention::attend_dense, "prompt_attention over one item's fp32 [kv_heads, N, dim] keys and values");
  m.def("prompt_attention_supports", &prompt_attention::supports, "whether this build has prompt_attention for (heads, kv_heads, dim)");
  m.def("shared_prefixes", &shared_prefix::find_groups, "groups of decode items sharing a prefix of whole pages");
}
#endif
