// bf16 linear layers on AMX (Sapphire Rapids and later) over a weight packed once, at load, in the
// tiles' own order: y = x W^T (+ b), products exact in fp32 and summed in fp32, rounded to bf16 once.
// The weight is [panels of 32 output columns][K steps of 32][two 16-column halves][16 K pairs][16
// columns][2], zero padded, so each K step of a panel is two contiguous 1 KB B tiles. One pass over a
// panel serves 32 rows of x (two A tiles, four accumulator tiles); threads split the panels, so each
// reads its share of the weight once per step whatever the row count up to 32, and once per 32 rows
// past it (the panel then comes again from L2). At a decode or verify step's 1 to 32 rows the
// multiplies take a fraction of the time the weights take to stream, so a 32-row verify step costs
// little more than an 8-row decode step (SmolLM2's bf16 weights, cold, 2-core Xeon: 12.7-13.0 ms at
// 8 rows and 13.9-14.8 at 32, against oneDNN's AMX kernel's 16.1-16.5 and 18.7-19.3; docs/benchmarks.md). Registered with the dispatcher with a
// shape-only Meta kernel, so compiled graphs call it (ops/cpu.py says when).
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int64_t kPanelColumns = 32;  // two 16-column B tiles
constexpr int64_t kStep = 32;          // K per tile: 16 rows of bf16 pairs
constexpr int64_t kTileBytes = 1024;   // one B tile: 16 K pairs x 16 columns x 2 bf16
constexpr int64_t kRowsPerPass = 32;   // two A tiles of 16 rows
// K steps whose weights are prefetched ahead of the tiles' loads (into L1, on past a panel's end into
// the next): of 0, 1, 2, 4 and 8, 2 ran best, 32 rows 15.8 -> 13.2-14.1 ms per SmolLM2 step's weights.
constexpr int64_t kPrefetchSteps = 2;
// Linux's arch_prctl request and feature number for the tile data state, which a process must ask
// for before its first tile instruction (Documentation/arch/x86/xstate.rst).
constexpr int kArchRequestPermission = 0x1023;
constexpr int kTileDataFeature = 18;

using infer_recipes::TileConfig;

// Tiles: 0-3 accumulate (rows 0-15 | 16-31) x (columns 0-15 | 16-31), 4-5 hold x's two row halves,
// 6-7 the weight's two column halves. A pass of fewer than 17 rows leaves tiles 2, 3 and 5 unused.
TileConfig config_for(int64_t rows) {
  const uint8_t low = static_cast<uint8_t>(std::min<int64_t>(rows, 16));
  const uint8_t high = static_cast<uint8_t>(std::max<int64_t>(rows - 16, 1));
  TileConfig config;
  for (int tile = 0; tile < 8; ++tile) config.bytes_per_row[tile] = 64;
  config.rows[0] = config.rows[1] = config.rows[4] = low;
  config.rows[2] = config.rows[3] = config.rows[5] = high;
  config.rows[6] = config.rows[7] = 16;
  return config;
}

// One panel times `rows` (at most 32) rows of x (row stride x_stride elements, K padded to whole
// steps), written to out (row stride ldo) as bf16, columns [0, columns), plus the bias (nullable).
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) void panel_pass(
    const at::BFloat16* x, int64_t x_stride, int64_t rows, int64_t steps, const char* panel, const float* bias,
    at::BFloat16* out, int64_t ldo, int64_t columns) {
  const bool two_halves = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  if (two_halves) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_bytes = x_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t s = 0; s < steps; ++s) {
    const char* weights = panel + s * 2 * kTileBytes;
    for (int64_t line = 0; line < 2 * kTileBytes; line += 64) {
      _mm_prefetch(weights + kPrefetchSteps * 2 * kTileBytes + line, _MM_HINT_T0);
    }
    _tile_loadd(6, weights, 64);
    _tile_loadd(7, weights + kTileBytes, 64);
    _tile_loadd(4, x + s * kStep, x_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two_halves) {
      _tile_loadd(5, x + 16 * x_stride + s * kStep, x_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float sums[kRowsPerPass][kPanelColumns];
  _tile_stored(0, &sums[0][0], kPanelColumns * sizeof(float));
  _tile_stored(1, &sums[0][16], kPanelColumns * sizeof(float));
  if (two_halves) {
    _tile_stored(2, &sums[16][0], kPanelColumns * sizeof(float));
    _tile_stored(3, &sums[16][16], kPanelColumns * sizeof(float));
  }
  infer_recipes::memory_barrier();
  const __mmask16 low = columns >= 16 ? 0xFFFF : (1u << columns) - 1;
  const __mmask16 high = columns >= 32 ? 0xFFFF : columns <= 16 ? 0 : (1u << (columns - 16)) - 1;
  const __m512 bias_low = bias ? _mm512_maskz_loadu_ps(low, bias) : _mm512_setzero_ps();
  const __m512 bias_high = bias ? _mm512_maskz_loadu_ps(high, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    // Rounded to nearest even, as torch rounds fp32 to bf16.
    const __m256bh y_low = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[r]), bias_low));
    const __m256bh y_high = _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(sums[r] + 16), bias_high));
    _mm256_mask_storeu_epi16(out + r * ldo, low, (__m256i)y_low);
    _mm256_mask_storeu_epi16(out + r * ldo + 16, high, (__m256i)y_high);
  }
}

// Panels [begin, end) for every row of x, 32 rows a pass; the tiles configured on this thread for
// the pass's row count (the last pass may have fewer rows).
__attribute__((target("amx-tile"))) void panels_for_rows(const at::BFloat16* x, int64_t x_stride, int64_t rows,
                                                         int64_t steps, const char* packed, int64_t begin, int64_t end,
                                                         const float* bias, at::BFloat16* out, int64_t out_features) {
  int64_t configured_rows = 0;
  for (int64_t p = begin; p < end; ++p) {
    const char* panel = packed + p * steps * 2 * kTileBytes;
    const int64_t column = p * kPanelColumns, columns = std::min(kPanelColumns, out_features - column);
    for (int64_t r = 0; r < rows; r += kRowsPerPass) {
      const int64_t pass_rows = std::min(kRowsPerPass, rows - r);
      if (pass_rows != configured_rows) {
        const TileConfig config = config_for(pass_rows);
        _tile_loadconfig(&config);
        configured_rows = pass_rows;
      }
      panel_pass(x + r * x_stride, x_stride, pass_rows, steps, panel, bias ? bias + column : nullptr,
                 out + r * out_features + column, out_features, columns);
    }
  }
  _tile_release();
}

torch::Tensor amx_linear_meta(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  return at::empty({x.size(0), out_features}, x.options());
}

}  // namespace

// Whether Linux lets this process use the tiles (asked once; fails where the CPU has none). ops/cpu.py
// checks the CPU's flags for AMX bf16 and AVX-512 BF16 first.
bool amx_available() {
  static const bool available = syscall(SYS_arch_prctl, kArchRequestPermission, kTileDataFeature) == 0;
  return available;
}

// [out, in] bf16 -> [panels, steps, 2, 16, 16, 2] bf16: panel p, K step s, column half h, K pair i,
// column c, element e holds W[32 p + 16 h + c][32 s + 2 i + e], zero past the weight's edges.
torch::Tensor pack_amx_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kBFloat16, "a bf16 [out, in] weight expected");
  weight = weight.contiguous();
  const int64_t out_features = weight.size(0), k = weight.size(1);
  const int64_t panels = (out_features + kPanelColumns - 1) / kPanelColumns, steps = (k + kStep - 1) / kStep;
  auto packed = torch::zeros({panels, steps, 2, 16, 16, 2}, weight.options());
  const at::BFloat16* source = weight.data_ptr<at::BFloat16>();
  at::BFloat16* target = packed.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      for (int64_t j = 0; j < std::min(kPanelColumns, out_features - p * kPanelColumns); ++j) {
        const at::BFloat16* row = source + (p * kPanelColumns + j) * k;
        const int64_t half = j / 16, c = j % 16;
        for (int64_t kk = 0; kk < k; ++kk) {
          const int64_t s = kk / kStep, pair = kk % kStep / 2, e = kk % 2;
          target[((((p * steps + s) * 2 + half) * 16 + pair) * 16 + c) * 2 + e] = row[kk];
        }
      }
    }
  });
  return packed;
}

torch::Tensor amx_linear(const torch::Tensor& x_in, const torch::Tensor& packed,
                         const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  TORCH_CHECK(amx_available(), "amx_linear needs a CPU with AMX bf16 and Linux's permission to use its tiles");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kBFloat16, "bf16 x [rows, in] expected");
  TORCH_CHECK(packed.dim() == 6 && packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.size(1) * kStep >= x_in.size(1) && packed.size(1) * kStep < x_in.size(1) + kStep &&
                  packed.size(0) * kPanelColumns >= out_features,
              "the packed weight does not fit x or out_features");
  const int64_t rows = x_in.size(0), steps = packed.size(1);
  // The A tiles read whole K steps: a K that is not one is padded with zeros (the weight is too).
  const torch::Tensor x = x_in.size(1) == steps * kStep
                              ? x_in.contiguous()
                              : at::constant_pad_nd(x_in, {0, steps * kStep - x_in.size(1)}).contiguous();
  torch::Tensor bias_values;
  if (bias.has_value()) bias_values = bias->to(torch::kFloat32).contiguous();
  auto out = torch::empty({rows, out_features}, x.options());
  if (rows == 0) return out;
  const char* weights = reinterpret_cast<const char*>(packed.data_ptr<at::BFloat16>());
  const float* bias_data = bias.has_value() ? bias_values.data_ptr<float>() : nullptr;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    panels_for_rows(x.data_ptr<at::BFloat16>(), steps * kStep, rows, steps, weights, begin, end, bias_data,
                    out.data_ptr<at::BFloat16>(), out_features);
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(infer_recipes, m) {
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes, CPU, m) { m.impl("amx_linear", &amx_linear); }
TORCH_LIBRARY_IMPL(infer_recipes, Meta, m) { m.impl("amx_linear", &amx_linear_meta); }

#else  // not x86-64 Linux: ops/cpu.py never picks the AMX layout

bool amx_available() { return false; }

torch::Tensor pack_amx_weight(torch::Tensor weight) { TORCH_CHECK(false, "pack_amx_weight needs x86-64 Linux"); }

#endif

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("amx_available() -> bool", &amx_available);
  m.def("pack_amx_weight(Tensor weight) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("pack_amx_weight", &pack_amx_weight);
}
