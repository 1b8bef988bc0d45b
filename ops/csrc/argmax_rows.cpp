// The greedy choice over a step's logits for the CPU: each row's first maximum, a NaN above any number
// (torch.argmax's answer). Two passes over the row, both in vectors: its maximum (and whether it holds a
// NaN), then the first element equal to it (or the first NaN), the row still in L2. torch's argmax and
// max(dim=-1) compare one element at a time: 0.34 to 2.5 ms over a verify step's 32 x 49,152 logits on
// two cores. AVX-512 where the CPU has it (chosen at run time), AVX2 where built with it, loops elsewhere.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace {

// The first index at or after `from` whose value is NaN (has_nan) or equals `top`, scalar.
template <typename scalar_t>
int64_t first_match_serial(const scalar_t* row, int64_t from, int64_t n, float top, bool has_nan) {
  for (int64_t i = from; i < n; ++i) {
    const float x = static_cast<float>(row[i]);
    if (has_nan ? x != x : x == top) return i;
  }
  return -1;
}

// Eight floats as one vector (AVX2 where built with it, two SSE registers otherwise); int8v: its masks.
typedef int32_t int8v __attribute__((vector_size(32)));
typedef uint16_t half8v __attribute__((vector_size(16)));

template <typename scalar_t>
inline infer_recipes::float8 load8(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return infer_recipes::load8(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    half8v bits;
    std::memcpy(&bits, p, sizeof bits);
    return reinterpret_cast<infer_recipes::float8>(__builtin_convertvector(bits, int8v) << 16);
  } else {
    infer_recipes::float8 v;
    for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(p[j]);
    return v;
  }
}

// The two passes in eight-float vectors.
template <typename scalar_t>
int64_t first_maximum_portable(const scalar_t* row, int64_t n) {
  using infer_recipes::float8;
  float8 top[2] = {infer_recipes::broadcast8(-std::numeric_limits<float>::infinity()),
                   infer_recipes::broadcast8(-std::numeric_limits<float>::infinity())};
  int8v nan = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int k = 0; k < 2; ++k) {
      const float8 x = load8(row + i + 8 * k);
      nan |= x != x;
      top[k] = top[k] < x ? x : top[k];
    }
  }
  float best = -std::numeric_limits<float>::infinity();
  bool has_nan = false;
  for (int j = 0; j < 8; ++j) {
    has_nan |= nan[j] != 0;
    best = std::max({best, top[0][j], top[1][j]});
  }
  for (int64_t t = i; t < n; ++t) {
    const float x = static_cast<float>(row[t]);
    has_nan |= x != x;
    best = x > best ? x : best;
  }
  const float8 target = infer_recipes::broadcast8(best);
  for (int64_t j = 0; j + 8 <= n; j += 8) {
    const float8 x = load8(row + j);
    const int8v match = has_nan ? x != x : x == target;
    for (int k = 0; k < 8; ++k) {
      if (match[k]) return j + k;
    }
  }
  return first_match_serial(row, n - n % 8, n, best, has_nan);
}

#if defined(__AVX2__) && defined(__FMA__)
namespace avx512_argmax {

template <typename scalar_t>
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const scalar_t* p) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return _mm512_loadu_ps(p);
  } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  } else {
    static_assert(std::is_same_v<scalar_t, c10::Half>, "float, bfloat16 or half rows");
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

template <typename scalar_t>
__attribute__((target("avx512f,avx512bw"))) int64_t first_maximum(const scalar_t* row, int64_t n) {
  constexpr int64_t kStep = 64;  // four vectors a pass: four independent max chains
  __m512 top[4];
  for (int k = 0; k < 4; ++k) top[k] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) {
    for (int k = 0; k < 4; ++k) {
      const __m512 x = load16(row + i + 16 * k);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      top[k] = _mm512_max_ps(top[k], x);
    }
  }
  for (; i + 16 <= n; i += 16) {
    const __m512 x = load16(row + i);
    nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    top[0] = _mm512_max_ps(top[0], x);
  }
  float best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
  bool has_nan = nan != 0;
  for (int64_t t = i; t < n; ++t) {
    const float x = static_cast<float>(row[t]);
    has_nan |= x != x;
    best = x > best ? x : best;
  }
  if (!has_nan) {
    // Every element of an all -inf row equals the -inf the search starts from: index 0, as torch.
    const __m512 target = _mm512_set1_ps(best);
    for (int64_t j = 0; j + 16 <= n; j += 16) {
      const __mmask16 equal = _mm512_cmp_ps_mask(load16(row + j), target, _CMP_EQ_OQ);
      if (equal) return j + __builtin_ctz(equal);
    }
  } else {
    for (int64_t j = 0; j + 16 <= n; j += 16) {
      const __m512 x = load16(row + j);
      const __mmask16 unordered = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      if (unordered) return j + __builtin_ctz(unordered);
    }
  }
  return first_match_serial(row, n - n % 16, n, best, has_nan);
}

}  // namespace avx512_argmax
#endif

template <typename scalar_t>
int64_t first_maximum(const scalar_t* row, int64_t n, bool wide) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (!std::is_same_v<scalar_t, double>) {
    if (wide) return avx512_argmax::first_maximum(row, n);
  }
#endif
  return first_maximum_portable(row, n);
}

}  // namespace

// `allow_avx512` false keeps to the eight-float path (its tests run it on any CPU).
torch::Tensor argmax_rows(torch::Tensor scores, bool allow_avx512) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0, "scores [rows, n] with n >= 1 expected");
  scores = scores.contiguous();
  const int64_t rows = scores.size(0), n = scores.size(1);
  auto out = torch::empty({rows}, scores.options().dtype(torch::kInt64));
  int64_t* indices = out.data_ptr<int64_t>();
#if defined(__AVX2__) && defined(__FMA__)
  const bool wide = allow_avx512 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
  const bool wide = false;
  (void)allow_avx512;
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, scores.scalar_type(), "argmax_rows", [&] {
    const scalar_t* data = scores.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) indices[r] = first_maximum(data + r * n, n, wide);
    });
  });
  return out;
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("argmax_rows(Tensor scores, bool allow_avx512) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
}
