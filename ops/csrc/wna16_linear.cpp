// Weight-only 4- and 8-bit linear layers for few rows (decode at batch 1..8): y = x W^T (+ b) with W
// held as unsigned codes u and, per group of `group` values along K, an fp32 scale s and offset o:
// w = fma(u, s, o). That one form holds symmetric int4/int8 (u = q + 8 or q + 128, o = -8 s or
// -128 s: exact), zero points (o = -(zp + 8) s, rounded once) and GGUF's Q4_1 (s = d, o = m) alike.
// The weights are read at 4 (or 8) bits instead of 32, which is what a decode step at batch 1 waits on.
//
// Layout (pack_wna16_weight): panels of 16 output columns; within one, for 4-bit codes, 16 bytes per
// pair of K (byte j = u[n_j][2i] | u[n_j][2i + 1] << 4), for 8-bit codes 16 bytes per K; the scales and
// offsets as [panels, K / group, 16]. Columns past N are zero. The kernel dequantizes 16 weights at a
// time in registers and multiplies them into up to four rows at once, so each panel is read once per
// four rows; threads split the panels. AVX-512 and AVX2 forms are chosen when called, by the CPU's
// flags; a scalar loop elsewhere. Each weight is the same fp32 value wna16_dequantize gives, so the
// output differs from F.linear over that dense weight only in the order of the sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

// Named, not anonymous: ops/cpu_kernels.py builds every source as one translation unit.
namespace wna16 {

constexpr int64_t kColumns = 16;  // one panel: one AVX-512 vector, two AVX2 ones
constexpr int kMaxRows = 4;       // rows per pass over a panel

struct Wna16 {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  int64_t k, group, bits;
  int64_t panel_bytes() const { return k * kColumns * bits / 8; }
  int64_t groups() const { return k / group; }
};

// The code of column j at K index kk of one panel.
inline int code_at(const uint8_t* panel, int64_t kk, int64_t j, int64_t bits) {
  if (bits == 8) return panel[kk * kColumns + j];
  const uint8_t byte = panel[(kk / 2) * kColumns + j];
  return kk % 2 == 0 ? byte & 0xF : byte >> 4;
}

void panel_scalar(const Wna16& w, int64_t p, const float* x, int64_t rows, float* out, int64_t ldo, int64_t columns,
                  const float* bias) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  for (int64_t j = 0; j < columns; ++j) {
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.0f;
      for (int64_t g = 0; g < w.groups(); ++g) {
        const float scale = w.scales[(p * w.groups() + g) * kColumns + j];
        const float offset = w.offsets[(p * w.groups() + g) * kColumns + j];
        for (int64_t kk = g * w.group; kk < (g + 1) * w.group; ++kk)
          sum += x[r * w.k + kk] * std::fma(static_cast<float>(code_at(panel, kk, j, w.bits)), scale, offset);
      }
      out[r * ldo + j] = sum + (bias ? bias[j] : 0.0f);
    }
  }
}

// The walk over panel p's codes that both vector forms share: per group, acc.group(p, g) loads its
// scales and offsets; per 16 bytes of codes, acc.step<load>(codes, kk), the load's place in a round of
// four telling the accumulators it adds into, so that at one row the fused multiply-adds are not one
// chain waiting on each other's latency. Inlined into each form's panel function (flatten), which
// gives it the ISA.
template <class Acc>
inline void walk_panel(const Wna16& w, int64_t p, Acc& acc) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  const int64_t per_load = w.bits == 4 ? 2 : 1;  // K values per 16 bytes of codes
  for (int64_t g = 0; g < w.groups(); ++g) {
    acc.group(p, g);
    const int64_t end = (g + 1) * w.group;
    int64_t kk = g * w.group;
    for (; kk + 4 * per_load <= end; kk += 4 * per_load) {
      acc.template step<0>(panel + (kk / per_load) * kColumns, kk);
      acc.template step<1>(panel + (kk / per_load + 1) * kColumns, kk + per_load);
      acc.template step<2>(panel + (kk / per_load + 2) * kColumns, kk + 2 * per_load);
      acc.template step<3>(panel + (kk / per_load + 3) * kColumns, kk + 3 * per_load);
    }
    for (; kk < end; kk += per_load) acc.template step<0>(panel + (kk / per_load) * kColumns, kk);
  }
}

// AVX-512: one vector per 16 columns; four accumulators a row: 8-bit codes, one per load of a round;
// 4-bit codes (two K values a load), a pair per even or odd load.
template <int kRows>
struct Avx512Rows {
  const Wna16& w;
  const float* x;
  __m512 scale, offset;
  __m512 acc[kRows][4];

  __attribute__((target("avx512f"))) void group(int64_t p, int64_t g) {
    scale = _mm512_loadu_ps(w.scales + (p * w.groups() + g) * kColumns);
    offset = _mm512_loadu_ps(w.offsets + (p * w.groups() + g) * kColumns);
  }

  template <int kLoad>
  __attribute__((target("avx512f"))) void step(const uint8_t* codes_at, int64_t kk) {
    constexpr int kPair = 2 * (kLoad % 2);
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes_at)));
    if (w.bits == 4) {
      const __m512 even =
          _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(0xF))), scale, offset);
      const __m512 odd = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4)), scale, offset);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r) {
        acc[r][kPair] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * w.k + kk]), even, acc[r][kPair]);
        acc[r][kPair + 1] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * w.k + kk + 1]), odd, acc[r][kPair + 1]);
      }
    } else {
      const __m512 weight = _mm512_fmadd_ps(_mm512_cvtepi32_ps(codes), scale, offset);
#pragma GCC unroll 4
      for (int r = 0; r < kRows; ++r)
        acc[r][kLoad] = _mm512_fmadd_ps(_mm512_set1_ps(x[r * w.k + kk]), weight, acc[r][kLoad]);
    }
  }
};

template <int kRows>
__attribute__((target("avx512f"), flatten)) void panel_rows_avx512(const Wna16& w, int64_t p, const float* x,
                                                                    float* out, int64_t ldo, int64_t columns,
                                                                    const float* bias) {
  Avx512Rows<kRows> acc{w, x, _mm512_setzero_ps(), _mm512_setzero_ps(), {}};
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) acc.acc[r][c] = _mm512_setzero_ps();
  walk_panel(w, p, acc);
  const __mmask16 mask = columns >= kColumns ? 0xffff : static_cast<__mmask16>((1u << columns) - 1);
  const __m512 bias_v = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
  for (int r = 0; r < kRows; ++r) {
    const __m512 sum =
        _mm512_add_ps(_mm512_add_ps(acc.acc[r][0], acc.acc[r][1]), _mm512_add_ps(acc.acc[r][2], acc.acc[r][3]));
    _mm512_mask_storeu_ps(out + r * ldo, mask, _mm512_add_ps(sum, bias_v));
  }
}

// AVX2: two 8-column halves; accumulators [row][half][load parity].
template <int kRows>
struct Avx2Rows {
  const Wna16& w;
  const float* x;
  __m256 scale[2], offset[2];
  __m256 acc[kRows][2][2];

  __attribute__((target("avx2,fma"))) void group(int64_t p, int64_t g) {
    const float* scales = w.scales + (p * w.groups() + g) * kColumns;
    const float* offsets = w.offsets + (p * w.groups() + g) * kColumns;
    for (int h = 0; h < 2; ++h) {
      scale[h] = _mm256_loadu_ps(scales + 8 * h);
      offset[h] = _mm256_loadu_ps(offsets + 8 * h);
    }
  }

  template <int kLoad>
  __attribute__((target("avx2,fma"))) void step(const uint8_t* codes_at, int64_t kk) {
    constexpr int kSet = kLoad % 2;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes_at));
    const __m256i codes[2] = {_mm256_cvtepu8_epi32(bytes), _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8))};
    for (int h = 0; h < 2; ++h) {
      if (w.bits == 4) {
        const __m256 even = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_and_si256(codes[h], _mm256_set1_epi32(0xF))), scale[h], offset[h]);
        const __m256 odd = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(codes[h], 4)), scale[h], offset[h]);
#pragma GCC unroll 4
        for (int r = 0; r < kRows; ++r) {
          acc[r][h][kSet] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * w.k + kk]), even, acc[r][h][kSet]);
          acc[r][h][kSet] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * w.k + kk + 1]), odd, acc[r][h][kSet]);
        }
      } else {
        const __m256 weight = _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes[h]), scale[h], offset[h]);
#pragma GCC unroll 4
        for (int r = 0; r < kRows; ++r)
          acc[r][h][kSet] = _mm256_fmadd_ps(_mm256_set1_ps(x[r * w.k + kk]), weight, acc[r][h][kSet]);
      }
    }
  }
};

template <int kRows>
__attribute__((target("avx2,fma"), flatten)) void panel_rows_avx2(const Wna16& w, int64_t p, const float* x,
                                                                   float* out, int64_t ldo, int64_t columns,
                                                                   const float* bias) {
  Avx2Rows<kRows> acc{w, x, {}, {}, {}};
  for (int r = 0; r < kRows; ++r)
    for (int h = 0; h < 2; ++h) acc.acc[r][h][0] = acc.acc[r][h][1] = _mm256_setzero_ps();
  walk_panel(w, p, acc);
  for (int r = 0; r < kRows; ++r) {
    alignas(32) float values[kColumns];
    _mm256_store_ps(values, _mm256_add_ps(acc.acc[r][0][0], acc.acc[r][0][1]));
    _mm256_store_ps(values + 8, _mm256_add_ps(acc.acc[r][1][0], acc.acc[r][1][1]));
    for (int64_t j = 0; j < columns; ++j) out[r * ldo + j] = values[j] + (bias ? bias[j] : 0.0f);
  }
}

using PanelRows = void (*)(const Wna16&, int64_t, const float*, float*, int64_t, int64_t, const float*);

// One panel times every row, kMaxRows at a time, by the widest form the CPU runs.
void panel_all_rows(const Wna16& w, int64_t p, const float* x, int64_t rows, float* out, int64_t ldo, int64_t columns,
                    const float* bias, int isa) {
  static constexpr PanelRows kAvx512[] = {panel_rows_avx512<1>, panel_rows_avx512<2>, panel_rows_avx512<3>,
                                          panel_rows_avx512<4>};
  static constexpr PanelRows kAvx2[] = {panel_rows_avx2<1>, panel_rows_avx2<2>, panel_rows_avx2<3>,
                                        panel_rows_avx2<4>};
  for (int64_t r = 0; r < rows; r += kMaxRows) {
    const int64_t count = std::min<int64_t>(kMaxRows, rows - r);
    if (isa == 2)
      kAvx512[count - 1](w, p, x + r * w.k, out + r * ldo, ldo, columns, bias);
    else if (isa == 1)
      kAvx2[count - 1](w, p, x + r * w.k, out + r * ldo, ldo, columns, bias);
    else
      panel_scalar(w, p, x + r * w.k, count, out + r * ldo, ldo, columns, bias);
  }
}

int isa_for_cpu() {
  if (__builtin_cpu_supports("avx512f")) return 2;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

void check_layout(const torch::Tensor& packed, const torch::Tensor& scales, const torch::Tensor& offsets, int64_t k,
                  int64_t group, int64_t bits, int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "wna16: 4- or 8-bit codes, got ", bits);
  TORCH_CHECK(group > 0 && k % group == 0 && group % 2 == 0, "wna16: the group must divide K and be even");
  const int64_t panels = (out_features + kColumns - 1) / kColumns;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == panels && packed.size(1) == k * kColumns * bits / 8,
              "wna16: the packed codes do not fit K, N and the bits");
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 3 && t->size(0) == panels &&
                    t->size(1) == k / group && t->size(2) == kColumns,
                "wna16: scales and offsets must be fp32 [panels, K / group, 16]");
}

}  // namespace wna16

std::vector<torch::Tensor> pack_wna16_weight(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                                             int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8, "wna16: uint8 codes [N, K] expected");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.sizes() == offsets.sizes() && k % scales.size(1) == 0,
              "wna16: scales and offsets must be [N, K / group]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(bits == 4 || bits == 8, "wna16: 4- or 8-bit codes, got ", bits);
  TORCH_CHECK(bits == 8 || k % 2 == 0, "wna16: 4-bit codes need an even K");
  codes = codes.contiguous();
  auto scale32 = scales.to(torch::kFloat32).contiguous(), offset32 = offsets.to(torch::kFloat32).contiguous();
  const int64_t panels = (n + wna16::kColumns - 1) / wna16::kColumns;
  auto packed = torch::zeros({panels, k * wna16::kColumns * bits / 8}, codes.options());
  auto packed_scales = torch::zeros({panels, groups, wna16::kColumns}, scale32.options());
  auto packed_offsets = torch::zeros({panels, groups, wna16::kColumns}, scale32.options());
  const uint8_t* source = codes.data_ptr<uint8_t>();
  uint8_t* target = packed.data_ptr<uint8_t>();
  const float *s = scale32.data_ptr<float>(), *o = offset32.data_ptr<float>();
  float *ps = packed_scales.data_ptr<float>(), *po = packed_offsets.data_ptr<float>();
  const int64_t panel_bytes = packed.size(1);
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < std::min(wna16::kColumns, n - p * wna16::kColumns); ++j) {
        const int64_t row = p * wna16::kColumns + j;
        for (int64_t kk = 0; kk < k; ++kk) {
          const uint8_t code = source[row * k + kk];
          TORCH_CHECK(code < (1 << bits), "wna16: code ", int(code), " does not fit ", bits, " bits");
          if (bits == 8)
            target[p * panel_bytes + kk * wna16::kColumns + j] = code;
          else
            target[p * panel_bytes + (kk / 2) * wna16::kColumns + j] |= kk % 2 == 0 ? code : code << 4;
        }
        for (int64_t g = 0; g < groups; ++g) {
          ps[(p * groups + g) * wna16::kColumns + j] = s[row * groups + g];
          po[(p * groups + g) * wna16::kColumns + j] = o[row * groups + g];
        }
      }
    }
  });
  return {packed, packed_scales, packed_offsets};
}

torch::Tensor wna16_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                           c10::optional<torch::Tensor> bias, int64_t bits, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "wna16: fp32 x [rows, in] expected");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  const int64_t group = k / scales.size(1);
  wna16::check_layout(packed, scales, offsets, k, group, bits, out_features);
  torch::Tensor bias_values;
  if (bias.has_value()) bias_values = bias->to(torch::kFloat32).contiguous();
  auto out = torch::empty({rows, out_features}, x.options());
  const wna16::Wna16 w{packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), k, group, bits};
  const float* xs = x.data_ptr<float>();
  const float* bias_data = bias.has_value() ? bias_values.data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  const int isa = wna16::isa_for_cpu();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t column = p * wna16::kColumns, columns = std::min(wna16::kColumns, out_features - column);
      wna16::panel_all_rows(w, p, xs, rows, ys + column, out_features, columns, bias_data ? bias_data + column : nullptr, isa);
    }
  });
  return out;
}

torch::Tensor wna16_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                               int64_t out_features) {
  const int64_t k = packed.size(1) * 8 / (wna16::kColumns * bits), group = k / scales.size(1);
  wna16::check_layout(packed, scales, offsets, k, group, bits, out_features);
  auto dense = torch::empty({out_features, k}, scales.options());
  const wna16::Wna16 w{packed.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), k, group, bits};
  float* target = dense.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t p = n / wna16::kColumns, j = n % wna16::kColumns;
      const uint8_t* panel = w.codes + p * w.panel_bytes();
      for (int64_t kk = 0; kk < k; ++kk) {
        const int64_t at = (p * w.groups() + kk / group) * wna16::kColumns + j;
        target[n * k + kk] = std::fma(static_cast<float>(wna16::code_at(panel, kk, j, bits)), w.scales[at], w.offsets[at]);
      }
    }
  });
  return dense;
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("pack_wna16_weight(Tensor codes, Tensor scales, Tensor offsets, int bits) -> Tensor[]");
  m.def("wna16_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, Tensor? bias, int bits, "
        "int out_features) -> Tensor");
  m.def("wna16_dequantize(Tensor packed, Tensor scales, Tensor offsets, int bits, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("pack_wna16_weight", &pack_wna16_weight);
  m.impl("wna16_linear", &wna16_linear);
  m.impl("wna16_dequantize", &wna16_dequantize);
}
