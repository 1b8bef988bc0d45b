// fp32 linear layers for AVX2/FMA CPUs over a weight packed once, at load, into panels of 24 output
// columns ([panels, K, 24], zero padded): y = x W^T (+ b). Each panel is read sequentially, once per
// four rows of x, and 4 x 24 outputs stay in twelve registers for the whole K loop. At decode's few
// rows (a step of 32 requests) this streams the weights at 1.3x oneDNN's blocked kernel and up to 2x
// at one row on a Zen 3 EPYC (docs/benchmarks.md); at thousands of rows MKL's blocking of x wins, so
// module/packed_weights.py sends those to the plain weight.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace {

constexpr int64_t kPanelWidth = 24;  // three 8-float AVX2 vectors
constexpr int64_t kRowsPerPass = 4;  // 4 x 3 accumulators + 3 weight vectors + 1 broadcast: 16 registers

// kRows rows of x (row stride k) times one panel, written to out (row stride ldo), columns
// [0, columns) of the panel's 24; `prefetch` (nullable) is pulled into L2 meanwhile, a line per four
// steps of K.
template <int kRows>
inline void panel_product(const float* x, int64_t k, const float* panel, const float* bias, float* out, int64_t ldo,
                          int64_t columns, const char* prefetch) {
  __m256 acc[kRows][3];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* w = panel + kk * kPanelWidth;
    if (prefetch && (kk & 3) == 0) _mm_prefetch(prefetch + kk * 16, _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16);
    // Unrolled by the compiler (kRows is a constant), so the accumulators stay in registers.
#pragma GCC unroll 4
    for (int r = 0; r < kRows; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * k + kk);
      acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
      acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) {
    float* row = out + r * ldo;
    if (columns == kPanelWidth) {
      for (int j = 0; j < 3; ++j) {
        __m256 value = acc[r][j];
        if (bias) value = _mm256_add_ps(value, _mm256_loadu_ps(bias + 8 * j));
        _mm256_storeu_ps(row + 8 * j, value);
      }
    } else {  // the last panel of a width that is no multiple of 24
      alignas(32) float values[kPanelWidth];
      for (int j = 0; j < 3; ++j) _mm256_store_ps(values + 8 * j, acc[r][j]);
      for (int64_t j = 0; j < columns; ++j) row[j] = values[j] + (bias ? bias[j] : 0.0f);
    }
  }
}

// Every row of x times one panel. The first passes also pull `next_panel` (nullable) into L2, a
// sixth of it each, so that the next panel's first pass does not wait on memory (1.06x per decode
// step's linears, weights cold as in a real step).
void panel_rows(const float* x, int64_t rows, int64_t k, const float* panel, const float* bias, float* out,
                int64_t ldo, int64_t columns, const float* next_panel) {
  constexpr int64_t kPrefetchPasses = kPanelWidth * sizeof(float) * 4 / 64;  // 6
  int64_t r = 0;
  for (int64_t pass = 0; r + kRowsPerPass <= rows; r += kRowsPerPass, ++pass) {
    const char* prefetch = next_panel && pass < kPrefetchPasses
                               ? reinterpret_cast<const char*>(next_panel) + pass * 16 * k
                               : nullptr;
    panel_product<4>(x + r * k, k, panel, bias, out + r * ldo, ldo, columns, prefetch);
  }
  const float* x_rest = x + r * k;
  float* out_rest = out + r * ldo;
  switch (rows - r) {
    case 3: panel_product<3>(x_rest, k, panel, bias, out_rest, ldo, columns, nullptr); break;
    case 2: panel_product<2>(x_rest, k, panel, bias, out_rest, ldo, columns, nullptr); break;
    case 1: panel_product<1>(x_rest, k, panel, bias, out_rest, ldo, columns, nullptr); break;
    default: break;
  }
}

}  // namespace

torch::Tensor pack_linear_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "an fp32 [out, in] weight expected");
  weight = weight.contiguous();
  const int64_t out_features = weight.size(0), k = weight.size(1);
  const int64_t panels = (out_features + kPanelWidth - 1) / kPanelWidth;
  auto packed = torch::zeros({panels, k, kPanelWidth}, weight.options());
  const float* source = weight.data_ptr<float>();
  float* target = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min(kPanelWidth, out_features - p * kPanelWidth);
      for (int64_t j = 0; j < columns; ++j) {
        const float* row = source + (p * kPanelWidth + j) * k;
        for (int64_t kk = 0; kk < k; ++kk) target[(p * k + kk) * kPanelWidth + j] = row[kk];
      }
    }
  });
  return packed;
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "fp32 x [rows, in] expected");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == kPanelWidth &&
                  packed.size(0) * kPanelWidth >= out_features,
              "the packed weight does not fit x or out_features");
  x = x.contiguous();
  torch::Tensor bias_values;
  if (bias.has_value()) bias_values = bias->contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  auto out = torch::empty({rows, out_features}, x.options());
  const float* xs = x.data_ptr<float>();
  const float* weights = packed.data_ptr<float>();
  const float* bias_data = bias.has_value() ? bias_values.data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  // Threads split the panels, so each reads its share of the weight once.
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = weights + p * k * kPanelWidth;
      const int64_t column = p * kPanelWidth, columns = std::min(kPanelWidth, out_features - column);
      const float* panel_bias = bias_data ? bias_data + column : nullptr;
      const float* next_panel = p + 1 < end ? panel + k * kPanelWidth : nullptr;
      panel_rows(xs, rows, k, panel, panel_bias, ys + column, out_features, columns, next_panel);
    }
  });
  return out;
}

#else  // built without AVX2/FMA: ops/cpu_kernels.py never hands these out

torch::Tensor pack_linear_weight(torch::Tensor weight) { TORCH_CHECK(false, "pack_linear_weight needs AVX2 and FMA"); }

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                            int64_t out_features) {
  TORCH_CHECK(false, "packed_linear needs AVX2 and FMA");
}

#endif
