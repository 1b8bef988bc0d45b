// Fused elementwise ops for fp32 on the CPU: each row is read once and written once, where the
// torch reference makes a pass over memory, and a temporary, per operator (six for RMSNorm, five
// for the rotary embedding). Parallel over rows; same formulas as ops/torch_ref.py in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_math.h"

namespace {

// Elements per task: a decode step's few rows run on the calling thread, where waking a second
// one would cost more than the work; a prefill's thousands of rows are split.
constexpr int64_t kElementsPerTask = 1 << 15;

// Rows per task for rows of n elements.
inline int64_t rows_per_task(int64_t n) { return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(n, 1)); }

// out = weight * (x / sqrt(mean(x^2) + eps)) for one row of n.
inline void rms_norm_row(const float* x, const float* weight, float eps, float* out, int64_t n) {
  const float sum = infer_recipes::dot(x, x, n);
  const float inverse = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t d = 0; d < n; ++d) out[d] = weight[d] * (x[d] * inverse);
}

void check_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32, "fp32 expected");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(-1), "contiguous rows expected");
}

}  // namespace

torch::Tensor fused_rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = torch::empty_like(x);
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) rms_norm_row(in + row * n, w, static_cast<float>(eps), o + row * n, n);
  });
  return out;
}

// (rms_norm(x + residual), x + residual) in one pass over each row.
std::vector<torch::Tensor> fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, weight);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() && residual.scalar_type() == torch::kFloat32,
              "residual must match x");
  const int64_t n = x.size(-1), rows = x.numel() / n;
  auto out = torch::empty_like(x);
  auto sum = torch::empty_like(x);
  const float* a = x.data_ptr<float>();
  const float* b = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  float* s = sum.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(n), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      float* s_row = s + row * n;
      for (int64_t d = 0; d < n; ++d) s_row[d] = a[row * n + d] + b[row * n + d];
      rms_norm_row(s_row, w, static_cast<float>(eps), o + row * n, n);
    }
  });
  return {out, sum};
}

// [rows, 2I] -> [rows, I]: silu(gate) * up, the gate in the first half, in one vectorised loop per row.
torch::Tensor fused_silu_and_mul(torch::Tensor x) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(-1) % 2 == 0, "fp32 [rows, 2I] expected");
  const int64_t width = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto out_sizes = x.sizes().vec();
  out_sizes.back() = width;
  auto out = torch::empty(out_sizes, x.options());
  const float* in = x.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, rows_per_task(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float* gate = in + row * 2 * width;
      const float* up = gate + width;
      float* o_row = o + row * width;
      for (int64_t d = 0; d < width; ++d) o_row[d] = infer_recipes::silu(gate[d]) * up[d];
    }
  });
  return out;
}

// Rotates x [T, H, D] (last dim contiguous; any token and head strides) in place by cos/sin [T, D]
// (rows `trig_stride` apart), rotate_half convention: x1' = x1 cos1 - x2 sin1, x2' = x2 cos2 + x1 sin2
// over the two halves.
static void rotate_in_place(torch::Tensor& x, const float* cos, const float* sin, int64_t trig_stride) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  float* data = x.data_ptr<float>();
  at::parallel_for(0, tokens, rows_per_task(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * trig_stride;
      const float* s = sin + t * trig_stride;
      for (int64_t h = 0; h < heads; ++h) {
        float* row = data + t * token_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float first = row[i], second = row[i + half];
          row[i] = first * c[i] - second * s[i];
          row[i + half] = second * c[i + half] + first * s[i + half];
        }
      }
    }
  });
}

std::vector<torch::Tensor> fused_apply_rotary(torch::Tensor query, torch::Tensor key, torch::Tensor cos, torch::Tensor sin) {
  for (const auto& x : {query, key}) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
                "fp32 [T, H, D] with a contiguous, even last dim expected");
  }
  TORCH_CHECK(cos.dim() == 2 && cos.strides() == sin.strides() && cos.stride(1) == 1 && cos.scalar_type() == torch::kFloat32 &&
                  sin.scalar_type() == torch::kFloat32 && cos.size(1) == query.size(2),
              "fp32 cos/sin [T, D] with contiguous rows expected");
  rotate_in_place(query, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  rotate_in_place(key, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.stride(0));
  return {query, key};
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("fused_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor[]");
  m.def("fused_silu_and_mul(Tensor x) -> Tensor");
  m.def("fused_apply_rotary(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> Tensor[]");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("fused_rms_norm", &fused_rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("fused_silu_and_mul", &fused_silu_and_mul);
  m.impl("fused_apply_rotary", &fused_apply_rotary);
}
