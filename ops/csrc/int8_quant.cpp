// W8A8's two elementwise passes around torch._int_mm, each one pass over memory where the torch
// reference (ops/quant_math.py) makes five or six:
// - quantize_int8_per_token: x [T, K] fp32 -> (int8 [T, K], fp32 scale [T, 1]) with compressed-tensors'
//   values exactly: scale = max|x| / 127.5 (the fp32 eps where that is 0), q = clamp(round-half-even(
//   x / scale), -128, 127), by a true division as torch's, not a multiply by the reciprocal;
// - int8_rescale: int32 accumulators [T, N] -> fp32 acc * x_scale[t] * w_scale[n] (+ bias[n]), in the
//   reference's order of roundings (no fused multiply-add: contraction is off in this file).
// AVX-512 and AVX2 forms are chosen when called, by the CPU's flags; a scalar loop elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Named, not anonymous: ops/cpu_kernels.py builds every source as one translation unit.
namespace int8_quant {

constexpr float kInt8HalfRange = 127.5f;  // (qmax - qmin) / 2 for int8, compressed-tensors' symmetric divisor

inline float row_scale(float abs_max) {
  const float scale = abs_max / kInt8HalfRange;
  return scale == 0.0f ? FLT_EPSILON : scale;
}

inline int8_t quantize_value(float x, float scale) {
  float q = std::nearbyint(x / scale);  // the default rounding mode: half to even, as torch.round
  q = q < -128.0f ? -128.0f : (q > 127.0f ? 127.0f : q);
  return static_cast<int8_t>(q);
}

float quantize_row_scalar(const float* x, int64_t k, int8_t* q) {
  float abs_max = 0.0f;
  for (int64_t i = 0; i < k; ++i) abs_max = std::fmax(abs_max, std::fabs(x[i]));
  const float scale = row_scale(abs_max);
  for (int64_t i = 0; i < k; ++i) q[i] = quantize_value(x[i], scale);
  return scale;
}

__attribute__((target("avx2,fma"))) float quantize_row_avx2(const float* x, int64_t k, int8_t* q) {
  const __m256 sign_off = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 max_v = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) max_v = _mm256_max_ps(max_v, _mm256_and_ps(_mm256_loadu_ps(x + i), sign_off));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, max_v);
  float abs_max = 0.0f;
  for (float lane : lanes) abs_max = std::fmax(abs_max, lane);
  for (int64_t j = i; j < k; ++j) abs_max = std::fmax(abs_max, std::fabs(x[j]));
  const float scale = row_scale(abs_max);
  const __m256 scale_v = _mm256_set1_ps(scale), low = _mm256_set1_ps(-128.0f), high = _mm256_set1_ps(127.0f);
  for (i = 0; i + 8 <= k; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i), scale_v),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i ints = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, low), high));
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ints), _mm256_extracti128_si256(ints, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
  }
  for (; i < k; ++i) q[i] = quantize_value(x[i], scale);
  return scale;
}

// q = clamp(round-half-even(x / scale)) for a given scale: the second half of a dynamic row's
// quantization, and a static scale's whole.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void quantize_row_by_avx512(const float* x, int64_t k,
                                                                                 float scale, int8_t* q) {
  const __m512 scale_v = _mm512_set1_ps(scale), low = _mm512_set1_ps(-128.0f), high = _mm512_set1_ps(127.0f);
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (k - i)) - 1);
    // Masked-off lanes divide 1 by the scale: no exception, and they are not stored.
    const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), mask, x + i);
    const __m512 rounded = _mm512_roundscale_ps(_mm512_div_ps(v, scale_v), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i ints = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(rounded, low), high));
    _mm_mask_storeu_epi8(q + i, mask, _mm512_cvtepi32_epi8(ints));
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) float quantize_row_avx512(const float* x, int64_t k, int8_t* q) {
  __m512 max_v = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (k - i)) - 1);
    max_v = _mm512_max_ps(max_v, _mm512_abs_ps(_mm512_maskz_loadu_ps(mask, x + i)));
  }
  const float scale = row_scale(_mm512_reduce_max_ps(max_v));
  quantize_row_by_avx512(x, k, scale, q);
  return scale;
}

using QuantizeRow = float (*)(const float*, int64_t, int8_t*);

QuantizeRow quantize_row_for_cpu() {
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return quantize_row_avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return quantize_row_avx2;
  return quantize_row_scalar;
}

// Elements per thread below which a second thread costs more than it saves.
constexpr int64_t kElementsPerTask = 32768;

}  // namespace int8_quant

std::vector<torch::Tensor> quantize_int8_per_token(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "fp32 x [tokens, features] expected");
  x = x.contiguous();
  const int64_t tokens = x.size(0), k = x.size(1);
  auto values = torch::empty({tokens, k}, x.options().dtype(torch::kInt8));
  auto scales = torch::empty({tokens, 1}, x.options());
  const float* xs = x.data_ptr<float>();
  int8_t* qs = values.data_ptr<int8_t>();
  float* ss = scales.data_ptr<float>();
  const int8_quant::QuantizeRow quantize_row = int8_quant::quantize_row_for_cpu();
  at::parallel_for(0, tokens, std::max<int64_t>(1, int8_quant::kElementsPerTask / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) ss[t] = quantize_row(xs + t * k, k, qs + t * k);
                   });
  return {values, scales};
}

torch::Tensor int8_rescale(torch::Tensor accumulated, torch::Tensor x_scale, torch::Tensor w_scale,
                           c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(accumulated.dim() == 2 && accumulated.scalar_type() == torch::kInt32, "int32 [tokens, out] expected");
  const int64_t tokens = accumulated.size(0), n = accumulated.size(1);
  TORCH_CHECK(x_scale.numel() == tokens || x_scale.numel() == 1, "x_scale must hold one scale per token or one");
  TORCH_CHECK(w_scale.numel() == n, "w_scale must hold one scale per output column");
  accumulated = accumulated.contiguous();
  auto xsc = x_scale.to(torch::kFloat32).contiguous(), wsc = w_scale.to(torch::kFloat32).contiguous();
  torch::Tensor bias_values;
  if (bias.has_value()) bias_values = bias->to(torch::kFloat32).contiguous();
  auto out = torch::empty({tokens, n}, accumulated.options().dtype(torch::kFloat32));
  const int32_t* acc = accumulated.data_ptr<int32_t>();
  const float* x_scales = xsc.data_ptr<float>();
  const float* w_scales = wsc.data_ptr<float>();
  const float* bias_data = bias.has_value() ? bias_values.data_ptr<float>() : nullptr;
  const bool per_token = xsc.numel() == tokens && tokens > 1;
  float* ys = out.data_ptr<float>();
  at::parallel_for(0, tokens, std::max<int64_t>(1, int8_quant::kElementsPerTask / std::max<int64_t>(n, 1)),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t t = begin; t < end; ++t) {
                       const float token_scale = x_scales[per_token ? t : 0];
                       const int32_t* row = acc + t * n;
                       float* y = ys + t * n;
                       // Vectorised by the compiler; each product rounded on its own, as torch's.
                       for (int64_t j = 0; j < n; ++j) y[j] = static_cast<float>(row[j]) * token_scale * w_scales[j];
                       if (bias_data)
                         for (int64_t j = 0; j < n; ++j) y[j] = y[j] + bias_data[j];
                     }
                   });
  return out;
}

#pragma GCC pop_options

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("quantize_int8_per_token(Tensor x) -> Tensor[]");
  m.def("int8_rescale(Tensor accumulated, Tensor x_scale, Tensor w_scale, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("quantize_int8_per_token", &quantize_int8_per_token);
  m.impl("int8_rescale", &int8_rescale);
}
