// Shared by the CPU kernels (paged_attention.cpp, fused_ops.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

// e^x for x <= 0 in plain float arithmetic that compilers vectorise (std::exp stays a
// scalar libm call): e^x = 2^n e^r with n = round(x log2 e) set in the exponent bits and
// r = x - n ln 2 (Cody-Waite: ln 2 in two parts) in [-ln2/2, ln2/2], e^r by its Taylor
// series to degree 7: relative error 1.0e-7 over [-87, 0] against float64 (numpy's float32
// exp: 2.0e-7).
inline float exp_nonpositive(float x) {
  const float xc = std::max(x, -87.f);
  const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round (1.5 * 2^23)
  const float r = (xc - n * 0.693359375f) + n * 2.12194440e-4f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 +
                  r * (1.f / 720 + r * (1.f / 5040)))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x == -INFINITY ? 0.f : p * scale;
}
