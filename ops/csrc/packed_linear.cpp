// fp32 linear layers over a weight packed once, at load, into panels of output columns ([panels, K,
// width], zero padded): y = x W^T (+ b). Each panel is read sequentially, once per pass of a few rows
// of x, whose outputs stay in registers for the whole K loop; threads split the panels, so each reads
// its share of the weight once. Two widths, chosen by the CPU (ops/cpu.py):
// - 24 columns (three 8-float vectors, four rows a pass) on AVX2/FMA CPUs: at decode's few rows 1.3x
//   oneDNN's blocked kernel and up to 2x at one row on a Zen 3 EPYC (docs/benchmarks.md); under four
//   rows (decode, a verify of up to 2 drafts) the one pass pulls a third of the next panel into L2,
//   32 bytes a K step: 1.08x at one row and 1.13x at three per step's weights on a Zen 2 EPYC (16, a
//   sixth, and 48, a half, ran slower; the whole panel slower than none);
// - 32 columns (two 16-float vectors, twelve rows a pass, the next K steps and the next panel
//   prefetched) on AVX-512 CPUs: at 4 rows a step's weights stream at 28 GB/s on an AMX Xeon, against
//   MKL's 15 (plain) and 22 (packed), which is what a speculative verify step needs (docs/benchmarks.md).
// At thousands of rows MKL's blocking of x wins; ops/cpu.py sends those to the plain weight. The op
// is registered with the dispatcher (with a shape-only Meta kernel), so compiled graphs call it too.
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include <algorithm>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace avx2 {

constexpr int64_t kPanelWidth = 24;  // three 8-float AVX2 vectors: the AVX2 layout
constexpr int64_t kRowsPerPass = 4;  // 4 x 3 accumulators + 3 weight vectors + 1 broadcast: 16 registers

// kRows rows of x (row stride k) times one panel, written to out (row stride ldo), columns
// [0, columns) of the panel's 24; `prefetch` (nullable) is pulled into L2 meanwhile,
// kPrefetchBytes of it per step of K (a panel is 96 bytes a step: 16 pulls a sixth of one).
template <int kRows, int kPrefetchBytes = 16>
inline void panel_product(const float* x, int64_t k, const float* panel, const float* bias, float* out, int64_t ldo,
                          int64_t columns, const char* prefetch) {
  __m256 acc[kRows][3];
#pragma GCC unroll 4
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = acc[r][2] = _mm256_setzero_ps();
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* w = panel + kk * kPanelWidth;
    if (prefetch) {
      for (int64_t line = kk * kPrefetchBytes / 64; line < (kk + 1) * kPrefetchBytes / 64; ++line) {
        _mm_prefetch(prefetch + line * 64, _MM_HINT_T1);
      }
    }
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
  // under four rows this is the panel's only pass: it pulls a third of the next panel
  const char* next = r == 0 ? reinterpret_cast<const char*>(next_panel) : nullptr;
  switch (rows - r) {
    case 3: panel_product<3, 32>(x_rest, k, panel, bias, out_rest, ldo, columns, next); break;
    case 2: panel_product<2, 32>(x_rest, k, panel, bias, out_rest, ldo, columns, next); break;
    case 1: panel_product<1, 32>(x_rest, k, panel, bias, out_rest, ldo, columns, next); break;
    default: break;
  }
}

}  // namespace avx2

namespace avx512 {

constexpr int64_t kPanelWidth = 32;  // two 16-float vectors
constexpr int kRowsPerPass = 12;     // 12 x 2 accumulators + 2 weight vectors + 1 broadcast: 27 of 32 registers
// K steps (of 128 bytes) read ahead on a panel's first pass, running on into the next panel at its end;
// of 0, 8, 16, 32, 64 and 128 steps, 32 ran best from 4 to 32 rows (4 rows: 24.6 ms per SmolLM2
// step's weights, 28.4 without), before the next panel was prefetched too; beside that it still
// gains 1-6 % (a prototype, 4 to 32 rows).
constexpr int64_t kPrefetchSteps = 32;

// Cache lines of another panel pulled into L2 during one pass, spread evenly over its K steps.
struct PanelPrefetch {
  const char* lines = nullptr;  // the first line of this pass's share
  int64_t count = 0;
};

// kRows rows of x (row stride k) times one panel, written to out (row stride ldo), columns
// [0, columns) of the panel's 32; `read_ahead` prefetches the panel itself into L1 (the first pass),
// `next` another panel's share into L2.
template <int kRows>
__attribute__((target("avx512f"))) inline void panel_product(const float* x, int64_t k, const float* panel,
                                                             const float* bias, float* out, int64_t ldo,
                                                             int64_t columns, bool read_ahead, PanelPrefetch next) {
  __m512 acc[kRows][2];
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  int64_t due = 0;  // next.count per K step, in units of 1/k line: a line is due each time it passes k
  for (int64_t kk = 0; kk < k; ++kk) {
    const float* w = panel + kk * kPanelWidth;
    if (read_ahead) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchSteps * kPanelWidth), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchSteps * kPanelWidth + 16), _MM_HINT_T0);
    }
    for (due += next.count; due >= k; due -= k, next.lines += 64) _mm_prefetch(next.lines, _MM_HINT_T1);
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
#pragma GCC unroll 12
    for (int r = 0; r < kRows; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * k + kk]);
      acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);
    }
  }
  const __mmask16 low = columns >= 16 ? 0xFFFF : (1u << columns) - 1;
  const __mmask16 high = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : (1u << (columns - 16)) - 1;
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
#pragma GCC unroll 12
  for (int r = 0; r < kRows; ++r) {
    _mm512_mask_storeu_ps(out + r * ldo, low, _mm512_add_ps(acc[r][0], bias0));
    _mm512_mask_storeu_ps(out + r * ldo + 16, high, _mm512_add_ps(acc[r][1], bias1));
  }
}

// The first `rows` (at most kRows) rows of x times one panel.
template <int kRows>
__attribute__((target("avx512f"))) void rows_times_panel(int64_t rows, const float* x, int64_t k, const float* panel,
                                                         const float* bias, float* out, int64_t ldo, int64_t columns,
                                                         bool read_ahead, PanelPrefetch next) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      return rows_times_panel<kRows - 1>(rows, x, k, panel, bias, out, ldo, columns, read_ahead, next);
    }
  }
  panel_product<kRows>(x, k, panel, bias, out, ldo, columns, read_ahead, next);
}

// Every row of x times one panel, twelve rows a pass. The first pass reads the panel ahead into L1,
// and every pass pulls its share of `next_panel` (nullable) into L2, so that the weights stream from
// memory while the passes compute instead of between them: at 32 rows 1.2-1.3x, at 4-8 rows 1.1x
// per SmolLM2 step's weights (docs/benchmarks.md).
__attribute__((target("avx512f"))) void panel_rows(const float* x, int64_t rows, int64_t k, const float* panel,
                                                   const float* bias, float* out, int64_t ldo, int64_t columns,
                                                   const float* next_panel) {
  const int64_t lines = k * kPanelWidth * static_cast<int64_t>(sizeof(float)) / 64;
  for (int64_t r = 0; r < rows; r += kRowsPerPass) {
    const int64_t pass_rows = std::min<int64_t>(kRowsPerPass, rows - r);
    PanelPrefetch next;
    if (next_panel != nullptr) {  // a share in proportion to the pass's rows, so to its time
      const int64_t first = lines * r / rows;
      next = {reinterpret_cast<const char*>(next_panel) + 64 * first, lines * (r + pass_rows) / rows - first};
    }
    rows_times_panel<kRowsPerPass>(pass_rows, x + r * k, k, panel, bias, out + r * ldo, ldo, columns, r == 0, next);
  }
}

}  // namespace avx512

namespace {

torch::Tensor packed_linear_meta(const torch::Tensor& x, const torch::Tensor& packed,
                                 const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  return at::empty({x.size(0), out_features}, x.options());
}

}  // namespace

// [out, in] -> [panels, in, width], zero padded: the AVX2 layout at width 24, the AVX-512 one at 32.
torch::Tensor pack_linear_weight(torch::Tensor weight, int64_t width) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32, "an fp32 [out, in] weight expected");
  TORCH_CHECK(width == avx2::kPanelWidth || width == avx512::kPanelWidth, "panel width 24 or 32 expected");
  weight = weight.contiguous();
  const int64_t out_features = weight.size(0), k = weight.size(1);
  const int64_t panels = (out_features + width - 1) / width;
  auto packed = torch::zeros({panels, k, width}, weight.options());
  const float* source = weight.data_ptr<float>();
  float* target = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min(width, out_features - p * width);
      for (int64_t j = 0; j < columns; ++j) {
        const float* row = source + (p * width + j) * k;
        for (int64_t kk = 0; kk < k; ++kk) target[(p * k + kk) * width + j] = row[kk];
      }
    }
  });
  return packed;
}

torch::Tensor packed_linear(const torch::Tensor& x_in, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "fp32 x [rows, in] expected");
  const int64_t width = packed.dim() == 3 ? packed.size(2) : 0;
  TORCH_CHECK((width == avx2::kPanelWidth || width == avx512::kPanelWidth) && packed.size(1) == x_in.size(1) &&
                  packed.size(0) * width >= out_features && packed.is_contiguous(),
              "the packed weight does not fit x or out_features");
  const torch::Tensor x = x_in.contiguous();
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
      const float* panel = weights + p * k * width;
      const int64_t column = p * width, columns = std::min(width, out_features - column);
      const float* panel_bias = bias_data ? bias_data + column : nullptr;
      const float* next_panel = p + 1 < end ? panel + k * width : nullptr;
      if (width == avx512::kPanelWidth) {
        avx512::panel_rows(xs, rows, k, panel, panel_bias, ys + column, out_features, columns, next_panel);
      } else {
        avx2::panel_rows(xs, rows, k, panel, panel_bias, ys + column, out_features, columns, next_panel);
      }
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(infer_recipes, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(infer_recipes, Meta, m) { m.impl("packed_linear", &packed_linear_meta); }

#else  // built without AVX2/FMA: ops/cpu.py never hands the panels out, and the op is not registered

torch::Tensor pack_linear_weight(torch::Tensor weight, int64_t width) {
  TORCH_CHECK(false, "pack_linear_weight needs AVX2 and FMA");
}

#endif

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("pack_linear_weight(Tensor weight, int width) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
}
