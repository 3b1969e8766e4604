// Shared by the CPU custom calls: small math that must vectorize (libm's scalar calls do not).
#ifndef NIGHTJAR_CPU_MATH_H_
#define NIGHTJAR_CPU_MATH_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace nightjar {

// exp(x) for x <= 0 (a score minus its row maximum), Cephes' expf polynomial (~1 ulp): branch-free so the softmax
// loop vectorizes (std::exp is a scalar libm call, which dominated attention at batch 32). x < -87 (incl. -inf) -> 0.
inline float ExpNonPositive(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.0f ? 0.0f : e * scale;
}

// x * sigmoid(x) (SiLU) through ExpNonPositive(-|x|), branch-free: sigmoid(x) = 1 / (1 + e) for x >= 0 and
// e / (1 + e) below, e = exp(-|x|), so the exponent never overflows.
inline float Silu(float x) {
  const float e = ExpNonPositive(-std::fabs(x));
  const float inv = 1.0f / (1.0f + e);
  return x * (x >= 0.0f ? inv : e * inv);
}

}  // namespace nightjar

#endif  // NIGHTJAR_CPU_MATH_H_
