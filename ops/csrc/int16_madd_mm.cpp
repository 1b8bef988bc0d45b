// W8A8's int8 matmul on CPUs with AVX2 and no AVX-512 VNNI: [M, K] int8 x (W [N, K] int8)^T -> int32
// [M, N], exact, as torch._int_mm gives it. Where the CPU lacks VNNI, oneDNN runs torch._int_mm's
// signed-by-signed int8 product by a reference loop, 30-80x slower than fp32 at decode's shapes (Zen 2;
// docs/benchmarks.md). Here both operands are widened to 16 bits and multiplied by vpmaddwd (two
// products summed into 32 bits: no saturation for any int8 values, which vpmaddubsw's 16-bit sums would
// give), which on AVX2 multiplies as many pairs a cycle as fp32 fused multiply-adds do (Zen 2) or twice
// as many (Intel).
//
// Layout (pack_int16_madd_weight): panels of 8 output columns; within one, K/2 steps of 16 int16s,
// [c0: k, k+1, c1: k, k+1, ..., c7: k, k+1]; K and N padded with zeros. The kernel keeps 4 rows x 3
// panels (24 columns) of int32 sums in registers; per step it loads the 3 panels' 32 bytes once and
// broadcasts each row's pair of values. Threads split the columns, so each thread's panels stay in
// its caches across the row blocks.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

// Named, not anonymous: ops/cpu_kernels.py builds every source as one translation unit.
namespace int16_madd {

constexpr int64_t kColumns = 8;  // a panel: one AVX2 vector of int32 sums
constexpr int kRows = 4;         // rows a register block holds
constexpr int kPanels = 3;       // panels a register block holds

inline int64_t padded_k(int64_t k) { return (k + 1) / 2 * 2; }

// Rows of int8 values as int16 pairs [M, K padded to even].
torch::Tensor widened_rows(const torch::Tensor& a) {
  const int64_t k = a.size(1), kp = padded_k(k);
  auto wide = torch::zeros({a.size(0), kp}, a.options().dtype(torch::kInt16));
  wide.narrow(1, 0, k).copy_(a);
  return wide;
}

// One register block: `rows` (<= kRows) rows of `a` times `panels` (<= kPanels) panels, into out.
template <int kR, int kP>
__attribute__((target("avx2"))) void block_avx2(const int16_t* a, int64_t lda, const int16_t* w, int64_t panel_stride,
                                                int64_t steps, int32_t* out, int64_t ldo, int64_t columns) {
  __m256i acc[kR][kP];
  for (int r = 0; r < kR; ++r)
    for (int p = 0; p < kP; ++p) acc[r][p] = _mm256_setzero_si256();
  for (int64_t s = 0; s < steps; ++s) {
    __m256i weights[kP];
    for (int p = 0; p < kP; ++p)
      weights[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * panel_stride + s * 2 * kColumns));
    for (int r = 0; r < kR; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * s, sizeof(pair));
      const __m256i values = _mm256_set1_epi32(pair);
      for (int p = 0; p < kP; ++p) acc[r][p] = _mm256_add_epi32(acc[r][p], _mm256_madd_epi16(weights[p], values));
    }
  }
  for (int r = 0; r < kR; ++r) {
    alignas(32) int32_t sums[kP * kColumns];
    for (int p = 0; p < kP; ++p) _mm256_store_si256(reinterpret_cast<__m256i*>(sums + p * kColumns), acc[r][p]);
    std::memcpy(out + r * ldo, sums, sizeof(int32_t) * std::min<int64_t>(columns, kP * kColumns));
  }
}

using Block = void (*)(const int16_t*, int64_t, const int16_t*, int64_t, int64_t, int32_t*, int64_t, int64_t);

template <int kR>
constexpr Block kByPanels[] = {block_avx2<kR, 1>, block_avx2<kR, 2>, block_avx2<kR, 3>};
constexpr const Block* kForms[] = {kByPanels<1>, kByPanels<2>, kByPanels<3>, kByPanels<4>};

}  // namespace int16_madd

torch::Tensor pack_int16_madd_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kInt8, "int16_madd: int8 weight [N, K] expected");
  const int64_t n = weight.size(0), k = weight.size(1), kp = int16_madd::padded_k(k);
  const int64_t panels = (n + int16_madd::kColumns - 1) / int16_madd::kColumns;
  auto padded = torch::zeros({panels * int16_madd::kColumns, kp}, weight.options().dtype(torch::kInt16));
  padded.narrow(0, 0, n).narrow(1, 0, k).copy_(weight);
  // [panels, 8, K/2, 2] -> [panels, K/2, 8, 2]
  return padded.view({panels, int16_madd::kColumns, kp / 2, 2}).permute({0, 2, 1, 3}).contiguous().view({panels, -1});
}

torch::Tensor int16_madd_mm(torch::Tensor a, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(__builtin_cpu_supports("avx2"), "int16_madd_mm needs AVX2, which this CPU lacks");
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == torch::kInt8, "int16_madd: int8 rows [M, K] expected");
  const int64_t m = a.size(0), kp = int16_madd::padded_k(a.size(1));
  const int64_t panels = (out_features + int16_madd::kColumns - 1) / int16_madd::kColumns;
  TORCH_CHECK(packed.scalar_type() == torch::kInt16 && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == panels && packed.size(1) == kp * int16_madd::kColumns,
              "int16_madd: the packed weight does not fit K and N");
  const auto rows = int16_madd::widened_rows(a.contiguous());
  auto out = torch::empty({m, out_features}, a.options().dtype(torch::kInt32));
  const int16_t* a16 = rows.data_ptr<int16_t>();
  const int16_t* w = packed.data_ptr<int16_t>();
  int32_t* y = out.data_ptr<int32_t>();
  const int64_t panel_stride = kp * int16_madd::kColumns, steps = kp / 2;
  const int64_t column_blocks = (panels + int16_madd::kPanels - 1) / int16_madd::kPanels;
  at::parallel_for(0, column_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t first_panel = block * int16_madd::kPanels;
      const int64_t block_panels = std::min<int64_t>(int16_madd::kPanels, panels - first_panel);
      const int64_t column = first_panel * int16_madd::kColumns;
      const int64_t columns = std::min(block_panels * int16_madd::kColumns, out_features - column);
      for (int64_t r = 0; r < m; r += int16_madd::kRows) {
        const int64_t count = std::min<int64_t>(int16_madd::kRows, m - r);
        int16_madd::kForms[count - 1][block_panels - 1](a16 + r * kp, kp, w + first_panel * panel_stride,
                                                         panel_stride, steps, y + r * out_features + column,
                                                         out_features, columns);
      }
    }
  });
  return out;
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("pack_int16_madd_weight(Tensor weight) -> Tensor");
  m.def("int16_madd_mm(Tensor a, Tensor packed, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("pack_int16_madd_weight", &pack_int16_madd_weight);
  m.impl("int16_madd_mm", &int16_madd_mm);
}
