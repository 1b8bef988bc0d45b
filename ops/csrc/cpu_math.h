// Vectorisable dot product, exp and SiLU for the CPU kernels (ops/csrc/*.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace infer_recipes {

// Eight independent partial sums, so that the compiler vectorises the loop without -ffast-math.
inline float dot(const float* a, const float* b, int64_t n) {
  float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t d = 0;
  for (; d + 8 <= n; d += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += a[d + j] * b[d + j];
  }
  float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) + ((partial[4] + partial[5]) + (partial[6] + partial[7]));
  for (; d < n; ++d) sum += a[d] * b[d];
  return sum;
}

// exp(x) for x <= 0 in a form the compiler vectorises in any loop it is inlined into (no libm call):
// 2^k p(r) with x = k ln2 + r, |r| <= ln2 / 2, and Cephes' degree-6 polynomial for p (about 1 ulp).
// Inputs below -87 give exp(-87) ~ 1.6e-38, not 0: after the max is subtracted such weights are
// negligible. (It vectorises with -fno-trapping-math, which ops/cpu_kernels.py passes.)
inline float exp_nonpositive(float x) {
  const float v = x > -87.0f ? x : -87.0f;
  // Rounded to nearest by truncating v log2(e) - 1/2 toward zero (v <= 0).
  const int32_t k_int = static_cast<int32_t>(v * 1.44269504088896341f - 0.5f);
  const float k = static_cast<float>(k_int);
  const float r = (v - k * 0.693359375f) + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (k_int + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// exp_nonpositive over an array, in place.
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = exp_nonpositive(x[i]);
}

// The max and the sum of x[0, n), n >= 1, over eight lanes so that the compiler vectorises them (a serial
// sum waits on each add's latency).
inline float max_of(const float* x, int64_t n) {
  float lanes[8];
  for (int j = 0; j < 8; ++j) lanes[j] = x[0];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] = lanes[j] < x[i + j] ? x[i + j] : lanes[j];
  }
  for (; i < n; ++i) lanes[0] = lanes[0] < x[i] ? x[i] : lanes[0];
  for (int j = 1; j < 8; ++j) lanes[0] = lanes[0] < lanes[j] ? lanes[j] : lanes[0];
  return lanes[0];
}

inline float sum_of(const float* x, int64_t n) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) lanes[j] += x[i + j];
  }
  for (; i < n; ++i) lanes[0] += x[i];
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

// silu(x) = x sigmoid(x), with sigmoid from e = exp(-|x|) (never overflows): 1 / (1 + e) for x >= 0,
// e / (1 + e) below.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  return x * ((x >= 0.0f ? 1.0f : e) / (1.0f + e));
}

}  // namespace infer_recipes

namespace infer_recipes {

// Eight floats in one AVX register (two SSE ones without AVX), through the GCC/Clang vector extension:
// register-blocked matrix products name their accumulators, which plain loops leave the compiler to
// spill to memory.
typedef float float8 __attribute__((vector_size(32)));

inline float8 load8(const float* source) {
  float8 v;
  std::memcpy(&v, source, sizeof v);
  return v;
}

inline void store8(float* target, float8 v) { std::memcpy(target, &v, sizeof v); }

inline float8 broadcast8(float x) { return float8{x, x, x, x, x, x, x, x}; }

}  // namespace infer_recipes
