// W8A8's whole linear in one call, on CPUs with AVX-512 VNNI: y = (q(x) @ W_q^T) * s_x * s_w (+ b).
// Around torch._int_mm the layer makes three passes and an int32 [T, N] matrix: quantize x, multiply
// (oneDNN reorders its B operand into the VNNI layout on every call, which at a decode step's 32 rows
// costs about what the multiply does), rescale. Here the weight is laid out for VPDPBUSD once, at
// load, and each register tile of int32 sums is rescaled to fp32 in the tile's epilogue, while it
// is still in registers.
//
// VPDPBUSD multiplies unsigned by signed bytes, four per int32 lane: the activations are shifted to
// unsigned (q + 128, one XOR), and the 128 * sum_k w[n, k] this adds to column n is taken off in the
// epilogue (precomputed at packing). The sums are exact in int32 and the roundings are the
// reference's (ops/quant_math.py: per-token quantization as int8_quant.cpp, float(acc) * s_x * s_w,
// then + b; contraction off), so the outputs equal the reference's value for value.
//
// Layout (pack_int8_weight): panels of 16 output columns; within one, 64 bytes per step of 4 along
// K (byte 4j + i = w[n_j][4s + i]); columns past N and K past its end are zero. A register tile is
// up to 8 rows x 3 panels (24 accumulators); rows are taken in chunks of at most kRowChunk, whose
// unsigned bytes stay in L2 while every panel passes over them; threads split chunks x panel groups.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

// Named, not anonymous: ops/cpu_kernels.py builds every source as one translation unit.
namespace int8_linear {

constexpr int64_t kPanel = 16;     // output columns per panel: one zmm of int32 sums
constexpr int64_t kStepBytes = 64;  // one panel's bytes per step of 4 along K
constexpr int kTileRows = 8;
constexpr int kTilePanels = 3;
constexpr int64_t kRowChunk = 128;

inline int64_t steps_of(int64_t k) { return (k + 3) / 4; }

struct Epilogue {
  const int32_t* compensation;  // [panels * 16]: 128 * sum_k w[n, k]
  const float* w_scale;         // [N]
  const float* bias;            // [N] or null
  int64_t n;
};

template <int R, int P>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) void tile(
    const uint8_t* a, int64_t a_stride, const int8_t* panels, int64_t panel_bytes, int64_t steps,
    const float* x_scales, const Epilogue& e, int64_t col0, float* y, int64_t y_stride) {
  __m512i acc[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_si512();
  for (int64_t s = 0; s < steps; ++s) {
    __m512i b[P];
#pragma GCC unroll 3
    for (int p = 0; p < P; ++p) b[p] = _mm512_loadu_si512(panels + p * panel_bytes + s * kStepBytes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a + r * a_stride + s * 4, sizeof(four));
      const __m512i av = _mm512_set1_epi32(four);
#pragma GCC unroll 3
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], av, b[p]);
    }
  }
#pragma GCC unroll 3
  for (int p = 0; p < P; ++p) {
    const int64_t col = col0 + p * kPanel;
    if (col >= e.n) break;
    const __mmask16 mask = e.n - col >= kPanel ? 0xffff : static_cast<__mmask16>((1u << (e.n - col)) - 1);
    const __m512i comp = _mm512_loadu_si512(e.compensation + col);
    const __m512 w_scale = _mm512_maskz_loadu_ps(mask, e.w_scale + col);
    const __m512 bias = e.bias ? _mm512_maskz_loadu_ps(mask, e.bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][p], comp));
      v = _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(x_scales[r])), w_scale);
      if (e.bias) v = _mm512_add_ps(v, bias);
      _mm512_mask_storeu_ps(y + r * y_stride + col, mask, v);
    }
  }
}

using TileFn = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, int64_t, const float*, const Epilogue&,
                        int64_t, float*, int64_t);

template <int R>
constexpr TileFn tile_of(int panels) {
  return panels == 1 ? tile<R, 1> : panels == 2 ? tile<R, 2> : tile<R, 3>;
}

inline TileFn tile_for(int rows, int panels) {
  switch (rows) {
    case 1: return tile_of<1>(panels);
    case 2: return tile_of<2>(panels);
    case 3: return tile_of<3>(panels);
    case 4: return tile_of<4>(panels);
    case 5: return tile_of<5>(panels);
    case 6: return tile_of<6>(panels);
    case 7: return tile_of<7>(panels);
    default: return tile_of<8>(panels);
  }
}

// One row's int8 values (dynamic per token, or by the static scale) as unsigned bytes, zero-padded.
__attribute__((target("avx512f,avx512bw,avx512vl"))) float quantize_row_unsigned(
    const float* x, int64_t k, const float* static_scale, int8_t* q, int64_t padded) {
  float scale;
  if (static_scale) {
    scale = *static_scale;
    int8_quant::quantize_row_by_avx512(x, k, scale, q);
  } else {
    scale = int8_quant::quantize_row_avx512(x, k, q);
  }
  std::memset(q + k, 0, padded - k);
  for (int64_t i = 0; i < padded; ++i) q[i] = static_cast<int8_t>(static_cast<uint8_t>(q[i]) ^ 0x80u);
  return scale;
}

}  // namespace int8_linear

std::vector<torch::Tensor> pack_int8_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8, "int8 weight [out, in] expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + int8_linear::kPanel - 1) / int8_linear::kPanel, steps = int8_linear::steps_of(k);
  auto packed = torch::zeros({panels, steps * int8_linear::kStepBytes}, weight.options());
  auto compensation = torch::zeros({panels * int8_linear::kPanel}, weight.options().dtype(torch::kInt32));
  const int8_t* w = weight.data_ptr<int8_t>();
  int8_t* out = packed.data_ptr<int8_t>();
  int32_t* comp = compensation.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t col = begin; col < end; ++col) {
      int8_t* panel = out + (col / int8_linear::kPanel) * steps * int8_linear::kStepBytes;
      const int64_t j = col % int8_linear::kPanel;
      int32_t sum = 0;
      for (int64_t kk = 0; kk < k; ++kk) {
        const int8_t value = w[col * k + kk];
        panel[(kk / 4) * int8_linear::kStepBytes + j * 4 + kk % 4] = value;
        sum += value;
      }
      comp[col] = 128 * sum;
    }
  });
  return {packed, compensation};
}

torch::Tensor int8_linear_forward(torch::Tensor x, torch::Tensor packed, torch::Tensor compensation,
                                  torch::Tensor w_scale, c10::optional<torch::Tensor> input_scale,
                                  c10::optional<torch::Tensor> bias, int64_t out_features) {
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
              "int8_linear needs AVX-512 VNNI");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "fp32 x [tokens, features] expected");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kInt8, "a packed int8 weight expected");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), n = out_features;
  const int64_t steps = packed.size(1) / int8_linear::kStepBytes, panels = packed.size(0);
  TORCH_CHECK(steps == int8_linear::steps_of(k), "the packed weight's K does not match x's");
  TORCH_CHECK(panels * int8_linear::kPanel >= n && compensation.numel() == panels * int8_linear::kPanel,
              "the packed weight's columns do not match out_features");
  TORCH_CHECK(w_scale.numel() == n && w_scale.scalar_type() == torch::kFloat32, "fp32 w_scale [out] expected");
  auto w_scales = w_scale.contiguous();
  torch::Tensor bias_values, static_scale;
  if (bias.has_value()) bias_values = bias->to(torch::kFloat32).contiguous();
  if (input_scale.has_value()) static_scale = input_scale->to(torch::kFloat32).contiguous();
  TORCH_CHECK(!input_scale.has_value() || static_scale.numel() == 1, "a static input scale is one value");

  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  const int64_t padded = steps * 4;
  auto a = torch::empty({m, padded}, x.options().dtype(torch::kInt8));
  auto x_scales = torch::empty({m}, x.options());
  const float* xs = x.data_ptr<float>();
  int8_t* as = a.data_ptr<int8_t>();
  float* ss = x_scales.data_ptr<float>();
  const float* fixed = input_scale.has_value() ? static_scale.data_ptr<float>() : nullptr;
  at::parallel_for(0, m, std::max<int64_t>(1, 32768 / std::max<int64_t>(k, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      ss[t] = int8_linear::quantize_row_unsigned(xs + t * k, k, fixed, as + t * padded, padded);
  });

  const int8_linear::Epilogue epilogue{compensation.data_ptr<int32_t>(), w_scales.data_ptr<float>(),
                                       bias.has_value() ? bias_values.data_ptr<float>() : nullptr, n};
  const int64_t chunks = (m + int8_linear::kRowChunk - 1) / int8_linear::kRowChunk;
  const int64_t chunk_rows = (m + chunks - 1) / chunks;  // even chunks, so threads get even shares
  const int64_t groups = (panels + int8_linear::kTilePanels - 1) / int8_linear::kTilePanels;
  const int64_t panel_bytes = steps * int8_linear::kStepBytes;
  const int8_t* weights = packed.data_ptr<int8_t>();
  const auto* rows_u8 = reinterpret_cast<const uint8_t*>(as);
  float* ys = out.data_ptr<float>();
  at::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row0 = (task / groups) * chunk_rows, row_end = std::min(m, row0 + chunk_rows);
      const int64_t panel0 = (task % groups) * int8_linear::kTilePanels;
      const int tile_panels = static_cast<int>(std::min<int64_t>(int8_linear::kTilePanels, panels - panel0));
      for (int64_t r = row0; r < row_end; r += int8_linear::kTileRows) {
        const int tile_rows = static_cast<int>(std::min<int64_t>(int8_linear::kTileRows, row_end - r));
        int8_linear::tile_for(tile_rows, tile_panels)(rows_u8 + r * padded, padded, weights + panel0 * panel_bytes,
                                                      panel_bytes, steps, ss + r, epilogue,
                                                      panel0 * int8_linear::kPanel, ys + r * n, n);
      }
    }
  });
  return out;
}

#pragma GCC pop_options

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("pack_int8_weight(Tensor weight) -> Tensor[]");
  m.def("int8_linear_forward(Tensor x, Tensor packed, Tensor compensation, Tensor w_scale, Tensor? input_scale, "
        "Tensor? bias, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("pack_int8_weight", &pack_int8_weight);
  m.impl("int8_linear_forward", &int8_linear_forward);
}
