// Every decoder layer of a bf16 step of up to 255 rows (the bf16 linear's GEMM tiles; 32 on
// its panels alone) whose items have few new tokens each, in one C++ call: the
// same kernels, in the same order, as the Python loop of pie/backend/llama.py (add + RMSNorm,
// fused q/k/v, RoPE, KV write, paged attention, o, add + RMSNorm, gate/up, SiLU * up, down),
// so the result is bit-identical to it. Why: the loop made ~270 Python-dispatched calls per
// step, ~2.5 ms of a 14 ms batch-1 step on the Xeon of 2026-11-26 (2 vCPUs; figures:
// pie/backend/decode_step.py).
//
// The layers run inside one OpenMP parallel region: each thread takes its share of every
// linear's weight blocks, of the attention units and of the rows of the elementwise steps,
// with a barrier between steps, in place of ~150 regions a step (each op its own
// at::parallel_for, each region a fork and join, the small ops on one thread while the other
// waited) and their per-op tensors. Measured in-process at batch 1 (AMD EPYC Zen 4, 2 vCPUs):
// of 9.1 ms of layers, 7.3 were the linears' regions, whose threads were busy 6.4 of them, and
// attention's 0.9 ms did ~10 us of work a layer. The whole step, both builds alternating step
// by step in one process (context 128): 0.88x the op loop's time at batch 1, 0.91x at 4,
// 0.94x at 8, 0.96x at 16. Each thread streams its own half of a linear's blocks, claiming 2
// blocks at a time (3 where a GEMM tile spans 3: GemvCall::kClaimBlocks) from a counter of
// its own, and a thread done with its half takes what is left of the other's: when the OS
// takes a core from one thread mid-step (on 2 vCPUs the control process runs beside the
// backend), the other finishes its work instead of waiting at the barrier. With a competing
// process busy 1 ms in every ~12 (the same A/B): 0.95x at batch 1, 0.90x at 8 against fixed
// halves; level without it. Claiming from one shared counter instead was 1-15 % slower (the
// two streams interleave). A step that shares a
// prefix among its items (shared_prefix.h: batched products per group, their own parallel
// regions) keeps the op loop where the prefix's bf16 flash loop is missing (no AVX-512 BF16);
// with it, the prefix is a phase of each layer in the region (Bf16Prefixes).
// The kernels' sources are included (their bindings compiled out) so this is one extension.
#define PIE_NO_BINDINGS
#include "bf16_gemv.cpp"
#include "fused_ops.cpp"
#include "paged_attention.cpp"

#include <omp.h>

#include <atomic>
#include <cmath>
#include <optional>
#include <tuple>

namespace {

// Thread t's run of [0, n) cut into `threads` contiguous runs (at::parallel_for's split).
inline std::pair<int64_t, int64_t> run_of(int64_t n, int64_t t, int64_t threads) {
  const int64_t chunk = (n + threads - 1) / threads;
  return {std::min(n, t * chunk), std::min(n, (t + 1) * chunk)};
}

struct Step {
  int64_t tokens, hidden, heads, kv_heads, dim, inter, q_size, kv_size, page_size;
  float eps, scale;
  Shape attention() const { return Shape{heads, kv_heads, heads / kv_heads, dim, page_size}; }
};

// The greedy tail of a step whose output rows only draw greedily (decode_layers' `rows`): the final
// RMSNorm of rows `rows`, the LM head (bf16 panels, as Linear runs it) and the argmax of each
// row's bf16 logits, first index on ties and NaN above all, as torch.argmax over the fp32 copy
// of them — in the layers' region instead of four more Python-dispatched calls, a region of
// their own and the sampler's per-row work (~0.5 ms of a ~12 ms batch-1 step, Zen 4).
struct Head {
  const bf16* norm;  // [hidden]
  const bf16* w;     // pack() of the LM head [vocab, hidden]
  const bf16* wide;  // its pack_wide(), or nullptr
  int64_t vocab, n_rows;
  const int64_t* rows;  // [n_rows] rows of the step
  int64_t* tokens;      // [n_rows] out
};

// a ranks above b in torch.argmax's order: NaN above every number, then by value.
inline bool ranks_above(float a, float b) { return std::isnan(a) ? !std::isnan(b) : !std::isnan(b) && a > b; }

// `top` after row[b, e) in torch.argmax's order (the first of the highest; NaN above all), as a
// scan of every value with ranks_above would leave it. Blocks of 64 values with no NaN and
// none above `top` are skipped after one vector max: scanned value by value, the argmax of a
// 128-row greedy tail (6.3 M logits) was ~3.5 ms of a ~66 ms step (AMD EPYC Zen 5, 2 vCPUs;
// perf's samples, 2026-12-07).
inline void argmax_into(const bf16* row, int64_t b, int64_t e, std::pair<float, int64_t>& top) {
  constexpr int64_t kBlock = 64;
  typedef int32_t vmask __attribute__((vector_size(kLanes * sizeof(int32_t))));
  const auto scan = [&](int64_t from, int64_t to) {
    for (int64_t v = from; v < to; ++v) {
      const float value = static_cast<float>(row[v]);
      if (top.second < 0 || ranks_above(value, top.first)) top = {value, v};
    }
  };
  int64_t v = b;
  for (; v + kBlock <= e; v += kBlock) {
    if (top.second >= 0) {
      if (std::isnan(top.first)) return;  // nothing ranks above a NaN
      vfloat<kLanes> hi = load_vec<kLanes>(row + v);
      vmask nan = hi != hi;
      for (int64_t k = kLanes; k < kBlock; k += kLanes) {
        const vfloat<kLanes> x = load_vec<kLanes>(row + v + k);
        nan |= x != x;
        hi = x > hi ? x : hi;
      }
      bool any_nan = false, above = false;
      for (int l = 0; l < kLanes; ++l) any_nan |= nan[l] != 0, above |= hi[l] > top.first;
      if (!any_nan && !above) continue;
    }
    scan(v, v + kBlock);
  }
  scan(v, e);
}

// The op loop: one at::parallel_for per op (shared-prefix steps).
torch::Tensor layers_op_by_op(torch::Tensor x, const std::vector<torch::Tensor>& layers,
                              const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                              torch::Tensor cos, torch::Tensor sin, torch::Tensor write_slots, torch::Tensor q_indptr,
                              torch::Tensor kv_indptr, torch::Tensor kv_slots, torch::Tensor visible,
                              torch::Tensor mask_offsets, torch::Tensor masks, torch::Tensor enabled,
                              torch::Tensor groups, torch::Tensor scratch, const Step& s, const torch::Tensor& keep) {
  c10::optional<torch::Tensor> delta;
  for (size_t i = 0; i < k_pools.size(); ++i) {
    const torch::Tensor* w = layers.data() + 10 * i;
    auto xh = add_rms_norm(x, delta, w[0], s.eps);
    x = xh[0];
    const auto qkv = gemv(xh[1], w[1], w[6]);
    const auto qk = rope(qkv.slice(1, 0, s.q_size + s.kv_size).view({s.tokens, -1, s.dim}), cos, sin);
    const auto q = qk.slice(1, 0, s.heads), k = qk.slice(1, s.heads);
    const auto v = qkv.slice(1, s.q_size + s.kv_size).view({s.tokens, s.kv_heads, s.dim});
    write_kv(k_pools[i], v_pools[i], write_slots, k.contiguous(), v.contiguous());
    auto attn = paged_attention(q.to(at::kFloat).contiguous(), k_pools[i], v_pools[i], q_indptr,
                                      kv_indptr, kv_slots, visible, mask_offsets, masks, enabled, groups, scratch, s.scale)
                          .to(at::kBFloat16)
                          .reshape({s.tokens, s.q_size});
    if (keep.numel() && i + 1 == k_pools.size()) {  // past the last layer's attention: the kept rows
      x = x.index_select(0, keep);
      attn = attn.index_select(0, keep);
    }
    xh = add_rms_norm(x, gemv(attn, w[2], w[7]), w[3], s.eps);
    x = xh[0];
    delta = gemv(silu_mul(gemv(xh[1], w[4], w[8])), w[5], w[9]);
  }
  return delta.has_value() ? x + *delta : x;
}

// The same steps in one parallel region (see the top of the file).
template <int PS>
torch::Tensor layers_in_one_region(torch::Tensor x_in, const std::vector<torch::Tensor>& layers,
                                   const std::vector<torch::Tensor>& k_pools, const std::vector<torch::Tensor>& v_pools,
                                   torch::Tensor cos, torch::Tensor sin, torch::Tensor write_slots,
                                   torch::Tensor q_indptr, torch::Tensor kv_indptr, torch::Tensor kv_slots,
                                   torch::Tensor visible, torch::Tensor mask_offsets, torch::Tensor masks,
                                   torch::Tensor enabled, torch::Tensor groups, torch::Tensor scratch, const Step& s,
                                   const torch::Tensor& keep, const Head* head) {
  const int64_t T = s.tokens, n_layers = static_cast<int64_t>(k_pools.size());
  const int64_t qkv_n = s.q_size + 2 * s.kv_size, n_items = q_indptr.size(0) - 1;
  const auto opts = x_in.options();
  // The residual stream is updated in place: a copy, so the caller's embeddings stay as they were.
  torch::Tensor x = x_in.clone(), h = torch::empty_like(x), delta = torch::empty_like(x), o = torch::empty_like(x);
  torch::Tensor qkv = torch::empty({T, qkv_n}, opts), qk = torch::empty({T, s.heads + s.kv_heads, s.dim}, opts);
  torch::Tensor attn = torch::empty({T, s.q_size}, opts);
  torch::Tensor gate_up = torch::empty({T, 2 * s.inter}, opts), act = torch::empty({T, s.inter}, opts);
  const auto f32 = opts.dtype(at::kFloat);
  torch::Tensor qf = torch::empty({T, s.heads, s.dim}, f32);
  torch::Tensor out = torch::zeros({T, s.heads, s.dim}, f32);  // disabled items' rows stay zero, as in paged_attention
  torch::Tensor xs = torch::empty({T * std::max({s.hidden, s.q_size, s.inter})}, f32);  // the linears' input form
  // Past the last layer's attention only the rows `keep` go on (where not empty), gathered into
  // xk and ak, as llama.py's loop keeps only its output rows there: a linear's rows then see
  // the same number of rows beside them in both (bf16_gemv.cpp's GEMM tiles from kWideFrom
  // rows sum in another order than its loop, so a row's bits depend on that number).
  const int64_t K = keep.numel();
  torch::Tensor xk = torch::empty({K, s.hidden}, opts), ak = torch::empty({K, s.q_size}, opts);
  int64_t m = T;  // the rows of the linears and elementwise steps: T, then K past the last attention
  const int64_t R = head ? head->n_rows : 0;
  torch::Tensor hn = torch::empty({R, s.hidden}, opts), logits = torch::empty({R, head ? head->vocab : 0}, opts);
  bf16 *xp = x.data_ptr<bf16>(), *hp = h.data_ptr<bf16>(), *dp = delta.data_ptr<bf16>(), *op = o.data_ptr<bf16>();
  bf16 *qkvp = qkv.data_ptr<bf16>(), *qkp = qk.data_ptr<bf16>(), *ap = attn.data_ptr<bf16>();
  bf16 *gup = gate_up.data_ptr<bf16>(), *actp = act.data_ptr<bf16>();
  float *qfp = qf.data_ptr<float>(), *outp = out.data_ptr<float>(), *xsp = xs.data_ptr<float>();
  const bf16 *cp = cos.data_ptr<bf16>(), *sp = sin.data_ptr<bf16>();
  const int64_t* slot = write_slots.data_ptr<int64_t>();
  const int64_t *qi = q_indptr.data_ptr<int64_t>(), *ki = kv_indptr.data_ptr<int64_t>();
  const bool* on = enabled.data_ptr<bool>();
  // Items sharing a prefix (groups): its part of their attention, a phase of every layer.
  std::vector<shared_prefix::ItemPart> prefix(n_items);
  std::optional<shared_prefix::Bf16Prefixes> shared;
  if (groups.numel() && groups.data_ptr<int64_t>()[0] > 0)
    shared.emplace(groups, scratch, s.heads, s.kv_heads, s.dim, s.page_size, prefix);
  std::vector<std::atomic<int64_t>> prefix_cursor(shared ? n_layers : 0);  // each layer's next prefix unit
  for (auto& c : prefix_cursor) c.store(0, std::memory_order_relaxed);
  const auto weight = [&](int64_t i, int j) -> const bf16* {
    const torch::Tensor& t = layers[10 * i + j];
    return t.numel() ? t.data_ptr<bf16>() : nullptr;
  };
  // Projection j of layer i (1 q/k/v, 2 o, 4 gate/up, 5 down; their wide weights at 6-9).
  const auto linear = [&](int64_t i, int j, const bf16* in, int64_t k, int64_t n, bf16* y) {
    return GemvCall{in, weight(i, j), weight(i, j < 3 ? j + 5 : j + 4), m, k, n, y, xsp};
  };
  std::vector<std::vector<int64_t>> share;  // attention units by thread: the same plan for every layer
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  std::vector<std::pair<float, int64_t>> best(R * threads);  // the tail's argmax per row and thread
  // Per linear and thread: the next unclaimed block of that thread's half (each thread sets
  // its own when the region starts).
  const int64_t n_blocks[4] = {GemvCall::blocks_of(qkv_n), GemvCall::blocks_of(s.hidden),
                               GemvCall::blocks_of(2 * s.inter), GemvCall::blocks_of(s.hidden)};
  const int64_t n_linears = 4 * n_layers + (head ? 1 : 0);  // the LM head last
  std::vector<std::atomic<int64_t>> cursor(n_linears * threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    for (int64_t c = 0; c < n_linears; ++c)
      cursor[c * threads + t].store(
          run_of(c < 4 * n_layers ? n_blocks[c % 4] : GemvCall::blocks_of(head->vocab), t, nt).first,
          std::memory_order_relaxed);
#pragma omp single
    share = deal_units(qi, ki, on, prefix.data(), n_items, s.kv_heads, nt);  // (a barrier after it)
    int64_t r0, r1;  // this thread's rows of the elementwise steps
    std::tie(r0, r1) = run_of(T, t, nt);
    const std::pair<int64_t, int64_t> cols = run_of(s.inter, t, nt);  // and its columns of SiLU * up
    UnitScratch unit(s.attention());
    std::vector<float> row(s.hidden);
    // Linear c of the step, whose input this thread wrote rows [i0, i1) of: their input form
    // (AVX2), a barrier, this thread's half of the blocks and then what is left of the
    // others', a barrier.
    const auto linear_on_rows = [&](const GemvCall& call, int64_t c, int64_t i0, int64_t i1) {
      if (call.needs_input()) call.input(i0, i1);
#pragma omp barrier
      const int64_t blocks = call.blocks();
      for (int64_t k = 0; k < nt; ++k) {
        const int64_t u = (t + k) % nt, end = run_of(blocks, u, nt).second;
        std::atomic<int64_t>& next = cursor[c * threads + u];
        for (int64_t b; (b = next.fetch_add(GemvCall::kClaimBlocks, std::memory_order_relaxed)) < end;)
          call.blocks(b, std::min(end, b + GemvCall::kClaimBlocks));
      }
#pragma omp barrier
    };
    const auto linear_on_own_rows = [&](const GemvCall& call, int64_t c) { linear_on_rows(call, c, r0, r1); };
    // A linear whose input the threads wrote in other shares (attention's units, SiLU's columns).
    const auto linear_after_others = [&](const GemvCall& call, int64_t c) {
#pragma omp barrier
      linear_on_own_rows(call, c);
    };
    for (int64_t i = 0; i < n_layers; ++i) {
      // x += delta (the last layer's MLP), h = RMSNorm(x).
      for (int64_t r = r0; r < r1; ++r)
        norm_row(xp + r * s.hidden, i ? dp + r * s.hidden : nullptr, weight(i, 0), xp + r * s.hidden,
                 hp + r * s.hidden, s.hidden, s.eps, row.data());
      linear_on_own_rows(linear(i, 1, hp, s.hidden, qkv_n, qkvp), 4 * i);
      // RoPE on q and k, q to fp32 for attention, k and v to this token's slot.
      bf16* kp = k_pools[i].data_ptr<bf16>();
      bf16* vp = v_pools[i].data_ptr<bf16>();
      for (int64_t r = r0; r < r1; ++r) {
        bf16* qk_r = qkp + r * (s.heads + s.kv_heads) * s.dim;
        rope_row(qkvp + r * qkv_n, cp + r * s.dim, sp + r * s.dim, qk_r, s.heads + s.kv_heads, s.dim);
        for (int64_t j = 0; j < s.q_size; ++j) qfp[r * s.q_size + j] = static_cast<float>(qk_r[j]);
        write_kv_row(kp, vp, slot[r], qk_r + s.q_size, qkvp + r * qkv_n + s.q_size + s.kv_size, s.kv_heads,
                     s.dim, s.page_size);
      }
#pragma omp barrier
      if (shared) {  // the prefixes repacked, a barrier, their units, a barrier
        const std::pair<int64_t, int64_t> tasks = run_of(shared->tasks(), t, nt);
        shared->repack(kp, vp, tasks.first, tasks.second);
#pragma omp barrier
        for (int64_t u; (u = prefix_cursor[i].fetch_add(1, std::memory_order_relaxed)) < shared->units();)
          shared->attend(u, qkp, (s.heads + s.kv_heads) * s.dim, qi, s.scale);
#pragma omp barrier
      }
      const Attention<bf16> a{qfp, kp, vp, outp, qi, ki, kv_slots.data_ptr<int64_t>(), visible.data_ptr<bool>(),
                              mask_offsets.data_ptr<int64_t>(), masks.data_ptr<bool>(), prefix.data(),
                              s.attention(), s.scale};
      for (size_t n = 0; n < share[t].size(); ++n) {
        const int64_t u = share[t][n];
        attend_unit<bf16, PS>(a, u, n + 1 < share[t].size() ? share[t][n + 1] : -1, unit);
        const int64_t b = u / s.kv_heads, head0 = (u % s.kv_heads) * (s.heads / s.kv_heads) * s.dim;
        const int64_t width = (s.heads / s.kv_heads) * s.dim;
        for (int64_t r = qi[b]; r < qi[b + 1]; ++r)  // this unit's heads of its tokens, to bf16
          for (int64_t j = head0; j < head0 + width; ++j) ap[r * s.q_size + j] = bf16(outp[r * s.q_size + j]);
      }
      if (K && i + 1 == n_layers) {
#pragma omp barrier
#pragma omp single
        {
          const int64_t* kr = keep.data_ptr<int64_t>();
          bf16 *xkp = xk.data_ptr<bf16>(), *akp = ak.data_ptr<bf16>();
          for (int64_t j = 0; j < K; ++j) {
            std::memcpy(xkp + j * s.hidden, xp + kr[j] * s.hidden, s.hidden * sizeof(bf16));
            std::memcpy(akp + j * s.q_size, ap + kr[j] * s.q_size, s.q_size * sizeof(bf16));
          }
          xp = xkp, ap = akp, m = K;
        }  // (a barrier)
        std::tie(r0, r1) = run_of(m, t, nt);
      }
      linear_after_others(linear(i, 2, ap, s.q_size, s.hidden, op), 4 * i + 1);
      for (int64_t r = r0; r < r1; ++r)
        norm_row(xp + r * s.hidden, op + r * s.hidden, weight(i, 3), xp + r * s.hidden, hp + r * s.hidden,
                 s.hidden, s.eps, row.data());
      linear_on_own_rows(linear(i, 4, hp, s.hidden, 2 * s.inter, gup), 4 * i + 2);
      for (int64_t r = 0; r < m; ++r)
        silu_cols(gup + r * 2 * s.inter, actp + r * s.inter, s.inter, cols.first, cols.second);
      linear_after_others(linear(i, 5, actp, s.inter, s.hidden, dp), 4 * i + 3);
    }
    for (int64_t r = r0; r < r1; ++r)  // x + the last MLP output, rounded as torch's bf16 add
      for (int64_t j = 0; j < s.hidden; ++j) xp[r * s.hidden + j] = bf16(static_cast<float>(xp[r * s.hidden + j]) +
                                                                          static_cast<float>(dp[r * s.hidden + j]));
    if (head) {
      const std::pair<int64_t, int64_t> own = run_of(R, t, nt);  // this thread's output rows
      bf16* hnp = hn.data_ptr<bf16>();
      bf16* lp = logits.data_ptr<bf16>();
#pragma omp barrier
      for (int64_t j = own.first; j < own.second; ++j)
        norm_row(xp + head->rows[j] * s.hidden, nullptr, head->norm, nullptr, hnp + j * s.hidden, s.hidden, s.eps,
                 row.data());
      linear_on_rows(GemvCall{hnp, head->w, head->wide, R, s.hidden, head->vocab, lp, xsp}, 4 * n_layers,
                     own.first, own.second);
      // Each thread's columns of every row, then each row's threads in column order.
      const std::pair<int64_t, int64_t> span = run_of(head->vocab, t, nt);
      for (int64_t j = 0; j < R; ++j) {
        std::pair<float, int64_t> top{-INFINITY, -1};
        argmax_into(lp + j * head->vocab, span.first, span.second, top);
        best[j * nt + t] = top;
      }
#pragma omp barrier
      for (int64_t j = own.first; j < own.second; ++j) {
        std::pair<float, int64_t> top{-INFINITY, -1};
        for (int64_t u = 0; u < nt; ++u) {
          const auto& c = best[j * nt + u];
          if (c.second >= 0 && (top.second < 0 || ranks_above(c.first, top.first))) top = c;
        }
        head->tokens[j] = top.second;
      }
    }
  }
  return K ? xk : x;
}

// The greedy tail's Head for rows `rows` of the `n` rows a step's last layer outputs, input x
// (checked: the region may not throw); its tokens go to a new [R] int64 tensor in `tokens`.
Head greedy_head(const torch::Tensor& x, int64_t n, const torch::Tensor& rows, const torch::Tensor& norm,
                 const torch::Tensor& lm_head, const torch::Tensor& lm_wide, torch::Tensor* tokens) {
  const int64_t hidden = x.size(1);
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "decode_layers: rows must be a contiguous int64 vector");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.numel(); ++j)
    TORCH_CHECK(r[j] >= 0 && r[j] < n, "decode_layers: row ", r[j], " is not a row of the step's output");
  check_bf16(norm, "norm");
  TORCH_CHECK(norm.is_contiguous() && norm.numel() == hidden, "decode_layers: norm must be [hidden]");
  TORCH_CHECK(lm_head.is_contiguous() && lm_head.scalar_type() == at::kBFloat16 && lm_head.dim() == 4 &&
                  lm_head.size(1) * kPanelCols == hidden,
              "decode_layers: lm_head must be pack() of a [vocab, hidden] weight");
  const int64_t vocab = lm_head.size(0) * kPanelRows;
  TORCH_CHECK(lm_wide.numel() == 0 || (lm_wide.is_contiguous() && lm_wide.numel() == vocab * hidden),
              "decode_layers: lm_wide must be pack_wide() of the LM head");
  TORCH_CHECK(rows.numel() <= kMaxTokens || (lm_wide.numel() > 0 && rows.numel() <= wide_to()),
              "decode_layers: ", rows.numel(), " greedy rows (1..", kMaxTokens, ", or 1..", wide_to(),
              " with the LM head's pack_wide())");
  *tokens = torch::empty({rows.numel()}, rows.options());
  return Head{norm.data_ptr<bf16>(), lm_head.data_ptr<bf16>(), lm_wide.numel() ? lm_wide.data_ptr<bf16>() : nullptr,
              vocab, rows.numel(), r, tokens->data_ptr<int64_t>()};
}

// The greedy tail by ops, for a shared-prefix step that keeps the op loop (no AVX-512 BF16):
// the same final norm, LM head panels and argmax over the fp32 copy of the bf16 logits.
torch::Tensor greedy_by_ops(const torch::Tensor& x, const torch::Tensor& rows, const torch::Tensor& norm,
                            const torch::Tensor& lm_head, const torch::Tensor& lm_wide, double eps) {
  const auto h = add_rms_norm(x.index_select(0, rows).contiguous(), c10::nullopt, norm, eps)[1];
  return gemv(h, lm_head, lm_wide).to(at::kFloat).argmax(-1);
}

}  // namespace

// x: [T, hidden] bf16 embeddings. layers: 10 tensors per layer (input norm, q/k/v, o, post
// norm, gate/up, down; then the four projections' pack_wide() weights, empty where none).
// The attention arguments are those of paged_attention(). Returns the last layer's residual
// stream (x + the last MLP output), before the final norm: of the rows `keep` ([K] int64 rows
// of the step, in that order) where it is not empty, of every row where it is; the last
// layer's o projection and MLP run on those rows only (as llama.py's loop runs them). Where
// `rows` ([R] int64 rows of that output) is not empty, the step's greedy tail (Head) instead:
// each row's argmax token ([R] int64), from the final norm `norm` and the LM head's pack()
// `lm_head` (and its pack_wide(), empty where none).
torch::Tensor decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& layers,
                            const std::vector<torch::Tensor>& k_pools,
                            const std::vector<torch::Tensor>& v_pools, torch::Tensor cos,
                            torch::Tensor sin, torch::Tensor write_slots, torch::Tensor q_indptr,
                            torch::Tensor kv_indptr, torch::Tensor kv_slots, torch::Tensor visible,
                            torch::Tensor mask_offsets, torch::Tensor masks, torch::Tensor enabled,
                            torch::Tensor groups, torch::Tensor scratch,
                            int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, torch::Tensor keep,
                            torch::Tensor rows, torch::Tensor norm, torch::Tensor lm_head, torch::Tensor lm_wide) {
  TORCH_CHECK(keep.scalar_type() == at::kLong && keep.dim() == 1 && keep.is_contiguous() && keep.numel() <= x.size(0),
              "decode_layers: keep must be a contiguous int64 vector of at most the step's rows");
  for (int64_t j = 0; j < keep.numel(); ++j)
    TORCH_CHECK(keep.data_ptr<int64_t>()[j] >= 0 && keep.data_ptr<int64_t>()[j] < x.size(0),
                "decode_layers: kept row ", keep.data_ptr<int64_t>()[j], " is not a row of the step");
  torch::Tensor tokens;
  std::optional<Head> tail;
  if (rows.numel())
    tail = greedy_head(x, keep.numel() ? keep.numel() : x.size(0), rows, norm, lm_head, lm_wide, &tokens);
  const Head* head = tail ? &*tail : nullptr;
  const int64_t n_layers = static_cast<int64_t>(k_pools.size());
  TORCH_CHECK(static_cast<int64_t>(layers.size()) == 10 * n_layers && v_pools.size() == k_pools.size(),
              "decode_layers: 10 weights and one key and value pool per layer");
  TORCH_CHECK(n_layers > 0, "decode_layers: no layers");
  const int64_t page_size = k_pools[0].size(3);
  const Step s{x.size(0), x.size(1), heads, kv_heads, head_dim, layers[4].size(0) * kPanelRows / 2,
               heads * head_dim, kv_heads * head_dim, page_size, static_cast<float>(eps),
               static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)))};
  // A step whose items share a prefix keeps the region where the prefix's flash loop exists
  // (shared_prefix.h, Bf16Prefixes), else the op loop with the prefix's fp32 products.
  const bool shared = groups.numel() > 0 && groups.data_ptr<int64_t>()[0] > 0;
  if (shared && !prompt_attention::supports(heads, kv_heads, head_dim)) {
    const auto out = layers_op_by_op(x, layers, k_pools, v_pools, cos, sin, write_slots, q_indptr, kv_indptr,
                                     kv_slots, visible, mask_offsets, masks, enabled, groups, scratch, s, keep);
    return head ? greedy_by_ops(out, rows, norm, lm_head, lm_wide, eps) : out;
  }
  // Everything the region reads is checked here: nothing inside it may throw.
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decode_layers: x must be contiguous [T, hidden]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == s.tokens * head_dim &&
                  sin.numel() == cos.numel(), "decode_layers: cos/sin must be contiguous [T, 1, D]");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(write_slots.scalar_type() == at::kLong && write_slots.numel() == s.tokens, "decode_layers: one write slot per token");
  for (int64_t i = 0; i < n_layers; ++i) {
    const auto& kp = k_pools[i];
    const auto& vp = v_pools[i];
    TORCH_CHECK(kp.scalar_type() == at::kBFloat16 && vp.scalar_type() == at::kBFloat16 && kp.is_contiguous() &&
                    vp.is_contiguous() && kp.dim() == 4 && kp.size(1) == kv_heads && kp.size(2) == head_dim &&
                    kp.size(3) == page_size && vp.sizes() == at::IntArrayRef({kp.size(0), kv_heads, page_size, head_dim}),
                "decode_layers: bf16 pools [pages, kv_heads, dim, page_size] and [pages, kv_heads, page_size, dim]");
    const torch::Tensor* w = layers.data() + 10 * i;
    const int64_t rows[4] = {s.q_size + 2 * s.kv_size, s.hidden, 2 * s.inter, s.hidden};
    const int64_t cols[4] = {s.hidden, s.q_size, s.hidden, s.inter};
    for (int j = 0; j < 4; ++j) {
      const auto& pw = w[j < 2 ? 1 + j : 2 + j];  // q/k/v, o, gate/up, down
      TORCH_CHECK(pw.is_contiguous() && pw.scalar_type() == at::kBFloat16 && pw.dim() == 4 &&
                      pw.size(0) * kPanelRows == rows[j] && pw.size(1) * kPanelCols == cols[j],
                  "decode_layers: layer ", i, " projection ", j, " is not pack() of a [", rows[j], ", ", cols[j], "] weight");
      const auto& wide = w[6 + j];
      TORCH_CHECK(wide.numel() == 0 || (wide.is_contiguous() && wide.numel() == rows[j] * cols[j]),
                  "decode_layers: layer ", i, " projection ", j, ": wide must be pack_wide() of the same weight");
      TORCH_CHECK(s.tokens <= kMaxTokens || (wide.numel() > 0 && s.tokens <= wide_to()), "decode_layers: ",
                  s.tokens, " rows (1..", kMaxTokens, ", or 1..", wide_to(), " with pack_wide() weights)");
    }
    TORCH_CHECK(w[0].numel() == s.hidden && w[3].numel() == s.hidden && w[0].is_contiguous() && w[3].is_contiguous(),
                "decode_layers: norm weights of [hidden]");
  }
  const int64_t capacity = k_pools[0].size(0) * page_size;
  const int64_t* slot = write_slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.tokens; ++r) TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, "KV slot out of range");
  const auto region = [&](auto page) {  // page: the page size as a compile-time constant (0: any)
    return layers_in_one_region<decltype(page)::value>(x, layers, k_pools, v_pools, cos, sin, write_slots, q_indptr,
                                                       kv_indptr, kv_slots, visible, mask_offsets, masks, enabled,
                                                       groups, scratch, s, keep, head);
  };
  const torch::Tensor out = page_size == 16 ? region(std::integral_constant<int, 16>{})
                            : page_size == 32 ? region(std::integral_constant<int, 32>{})
                            : page_size == 8  ? region(std::integral_constant<int, 8>{})
                                              : region(std::integral_constant<int, 0>{});
  return head ? tokens : out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_layers", &decode_layers, "all decoder layers of a bf16 decode step (CPU), and optionally its greedy tail");
}
