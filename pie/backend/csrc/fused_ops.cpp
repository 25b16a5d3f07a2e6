// The elementwise glue of a Llama layer in bf16, one call each where eager PyTorch makes
// 4-9 (each a Python dispatch and, above torch's grain, an OpenMP region): residual add +
// RMSNorm, RoPE on q and k, SiLU(gate) * up. Each rounds to bf16 exactly where the torch ops
// it replaces do (HF's arithmetic: norm in fp32, cast, scale by the weight in bf16), so a
// step differs from the eager one only in the order the mean of squares is summed.
// Rows run in parallel in tasks of 8 (a step of a few sequences stays on one thread: a
// parallel region costs more than a few rows).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "fast_exp.h"

namespace {

using bf16 = at::BFloat16;
constexpr int64_t ROWS_PER_TASK = 8;

inline float f(bf16 v) { return static_cast<float>(v); }
inline bf16 b(float v) { return static_cast<bf16>(v); }  // round to nearest even, as torch does

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kBFloat16 && t.device().is_cpu(), name, " must be a bf16 CPU tensor");
}

// One row of add_rms_norm: sum = bf16(in + d) (d may be null: sum = in, not written), out =
// w * bf16(sum * rsqrt(mean(sum^2) + eps)); `row` is `hidden` floats of scratch. The squares
// go into LANES partial sums (column j into lane j % LANES), added pairwise at the end: one
// running sum kept the loop scalar, a chain of dependent adds (add+norm 303 vs torch's 160
// us at 512 rows, AMD EPYC Zen 5, 2 vCPUs); in lanes it vectorises. The order is fixed, so
// a row's result does not depend on its batch or on how the rows are split between threads.
constexpr int64_t LANES = 16;
inline void norm_row(const bf16* in, const bf16* d, const bf16* w, bf16* sum, bf16* out, int64_t hidden,
                     float eps, float* row) {
  if (d)
    for (int64_t j = 0; j < hidden; ++j) row[j] = f(b(f(in[j]) + f(d[j])));
  else
    for (int64_t j = 0; j < hidden; ++j) row[j] = f(in[j]);
  float lanes[LANES] = {};
  int64_t j = 0;
  for (; j + LANES <= hidden; j += LANES)
    for (int64_t k = 0; k < LANES; ++k) lanes[k] += row[j + k] * row[j + k];
  for (int64_t k = 0; j < hidden; ++j, ++k) lanes[k] += row[j] * row[j];
  for (int64_t width = LANES / 2; width > 0; width /= 2)
    for (int64_t k = 0; k < width; ++k) lanes[k] += lanes[k + width];
  if (d)
    for (int64_t c = 0; c < hidden; ++c) sum[c] = b(row[c]);
  const float scale = 1.f / std::sqrt(lanes[0] / static_cast<float>(hidden) + eps);
  for (int64_t c = 0; c < hidden; ++c) out[c] = b(f(w[c]) * f(b(row[c] * scale)));
}

// One row of rope: `heads` heads of `dim` at v (contiguous heads) -> y, with this row's cos/sin.
// The two halves of a head in loops of their own: with the half chosen inside one loop it
// stayed scalar.
inline void rope_row(const bf16* v, const bf16* ct, const bf16* st, bf16* y, int64_t heads, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h, v += dim, y += dim) {
    for (int64_t j = 0; j < half; ++j)
      y[j] = b(f(b(f(v[j]) * f(ct[j]))) + f(b(-f(v[j + half]) * f(st[j]))));
    for (int64_t j = half; j < dim; ++j)
      y[j] = b(f(b(f(v[j]) * f(ct[j]))) + f(b(f(v[j - half]) * f(st[j]))));
  }
}

// Columns [j0, j1) of one row of silu_mul: gate at g[j], up at g[inter + j].
inline void silu_cols(const bf16* g, bf16* y, int64_t inter, int64_t j0, int64_t j1) {
  for (int64_t j = j0; j < j1; ++j) {  // silu(v) = v * sigmoid(v), e^-|v| vectorised
    const float v = f(g[j]), e = exp_nonpositive(-std::fabs(v));
    const float sigmoid = v >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    y[j] = b(f(b(v * sigmoid)) * f(g[inter + j]));
  }
}

}  // namespace

// x = x + delta (delta may be None), h = weight * bf16(x * rsqrt(mean(x^2) + eps)); returns {x, h}.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> delta,
                                        torch::Tensor weight, double eps) {
  check_bf16(x, "x");
  check_bf16(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "add_rms_norm: x must be contiguous [T, hidden] and weight [hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  auto sum = delta.has_value() ? torch::empty_like(x) : x;
  const bf16* d = nullptr;
  if (delta.has_value()) {
    check_bf16(*delta, "delta");
    TORCH_CHECK(delta->is_contiguous() && delta->sizes() == x.sizes(), "add_rms_norm: delta must match x");
    d = delta->data_ptr<bf16>();
  }
  auto h = torch::empty_like(x);
  const bf16* in = x.data_ptr<bf16>();
  const bf16* w = weight.data_ptr<bf16>();
  bf16* s = sum.data_ptr<bf16>();
  bf16* out = h.data_ptr<bf16>();
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t o = i * hidden;
      norm_row(in + o, d ? d + o : nullptr, w, s + o, out + o, hidden, static_cast<float>(eps), row.data());
    }
  });
  return {sum, h};
}

// x: [T, heads, D] (rows may be strided, e.g. a slice of the fused qkv); cos, sin: [T, 1, D]
// contiguous. Returns x * cos + rotate_half(x) * sin, contiguous, each product and the sum
// rounded to bf16 as the three torch ops are.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rope: x must be [T, heads, D] with contiguous heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
              sin.numel() == cos.numel(), "rope: cos/sin must be contiguous [T, 1, D]");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2), stride = x.stride(0);
  auto out = torch::empty({rows, heads, dim}, x.options());
  const bf16* in = x.data_ptr<bf16>();
  const bf16* c = cos.data_ptr<bf16>();
  const bf16* sn = sin.data_ptr<bf16>();
  bf16* y = out.data_ptr<bf16>();
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) rope_row(in + t * stride, c + t * dim, sn + t * dim, y + t * heads * dim, heads, dim);
  });
  return out;
}

// gate_up: [T, 2I] -> bf16(silu(gate)) * up, [T, I].
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [T, 2 * intermediate]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = torch::empty({rows, inter}, gate_up.options());
  const bf16* g = gate_up.data_ptr<bf16>();
  bf16* y = out.data_ptr<bf16>();
  at::parallel_for(0, rows, ROWS_PER_TASK, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) silu_cols(g + t * 2 * inter, y + t * inter, inter, 0, inter);
  });
  return out;
}

#ifndef PIE_NO_BINDINGS  // csrc/decode_step.cpp includes this file for its functions
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm, HF's bf16 roundings (CPU)");
  m.def("rope", &rope, "rotary embedding on [T, heads, D], HF's bf16 roundings (CPU)");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up from the fused gate/up projection (CPU)");
}
#endif
