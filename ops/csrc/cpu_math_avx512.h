// cpu_math.h's exp in sixteen AVX-512 lanes, for the kernels that choose AVX-512 at run time (their
// functions carry the target attribute; the build's flags stay AVX2).
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>

namespace infer_recipes {

// exp_nonpositive (cpu_math.h) in sixteen lanes: the same reduction and polynomial.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive16(__m512 x) {
  const __m512 v = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512i k_int = _mm512_cvttps_epi32(_mm512_sub_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                                          _mm512_set1_ps(0.5f)));
  const __m512 k = _mm512_cvtepi32_ps(k_int);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(v, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(k, _mm512_set1_ps(2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(k_int, _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

}  // namespace infer_recipes
#endif
