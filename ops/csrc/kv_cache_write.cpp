// Writes a step's new K/V (or MLA latent) rows into the paged caches at their slots: one memcpy per
// token and cache, where index_copy_ pays a dispatch and an iterator setup per cache, which is most
// of its time at a decode step's few rows. A slot outside the cache is an error, never a write. An int8
// cache (C8) is written quantized, by compressed-tensors' formulas as ops/quant_math.py computes them:
// round(clamp(x / scale, -128, 127)), the scale per channel (static) or max|x| / 127.5 per token and
// KV head (dynamic, stored beside the values; a zero scale becomes fp32's eps).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "kv_int8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Tokens per task: a decode step's rows are copied on the calling thread (cheaper than waking one);
// a prefill's thousands are split.
constexpr int64_t kTokensPerTask = 512;

// Whether each token's row (every dim after the first) is one contiguous run: the token stride is
// free, so the K/V views of a fused QKV projection are written without a copy.
bool token_rows_contiguous(const torch::Tensor& rows) {
  int64_t expected = 1;
  for (int64_t d = rows.dim() - 1; d >= 1; --d) {
    if (rows.size(d) != 1 && rows.stride(d) != expected) return false;
    expected *= rows.size(d);
  }
  return true;
}

// rows [T, ...] must fit cache [num_blocks, block_size, ...] (same trailing dims and dtype).
void check_rows_fit_cache(const torch::Tensor& rows, const torch::Tensor& cache) {
  TORCH_CHECK(rows.device().is_cpu() && cache.device().is_cpu() && cache.is_contiguous(),
              "CPU rows and a contiguous CPU cache expected");
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type() || cache.scalar_type() == torch::kChar, "rows of ",
              rows.scalar_type(), " for a cache of ", cache.scalar_type());
  TORCH_CHECK(rows.dim() == cache.dim() - 1 && rows.sizes().slice(1) == cache.sizes().slice(2), "rows ", rows.sizes(),
              " do not fit cache ", cache.sizes());
}

// Copies token t's row of sources[i] into caches[i] at slot_mapping[t], for every cache in one pass.
// Rows whose tokens are not each one contiguous run are copied into such a layout first.
void write_rows(std::vector<torch::Tensor> sources, const std::vector<torch::Tensor>& caches,
                const torch::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 vector");
  const int64_t tokens = slot_mapping.size(0);
  const int64_t num_slots = caches[0].size(0) * caches[0].size(1);
  for (size_t i = 0; i < sources.size(); ++i) {
    check_rows_fit_cache(sources[i], caches[i]);
    if (!token_rows_contiguous(sources[i])) sources[i] = sources[i].contiguous();
    TORCH_CHECK(sources[i].size(0) == tokens && caches[i].size(0) * caches[i].size(1) == num_slots,
                "one slot per row and caches of one shape expected");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto [lowest, highest] = std::minmax_element(slots, slots + tokens);
  TORCH_CHECK(tokens == 0 || (*lowest >= 0 && *highest < num_slots), "slot_mapping must lie in [0, ", num_slots,
              "), got slots from ", *lowest, " to ", *highest);
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < sources.size(); ++i) {
      const int64_t row_bytes = caches[i].numel() / std::max<int64_t>(num_slots, 1) * caches[i].element_size();
      const char* source = static_cast<const char*>(sources[i].data_ptr());
      const int64_t token_bytes = sources[i].stride(0) * sources[i].element_size();
      char* cache = static_cast<char*>(caches[i].data_ptr());
      for (int64_t t = begin; t < end; ++t) {
        std::memcpy(cache + slots[t] * row_bytes, source + t * token_bytes, row_bytes);
      }
    }
  });
}

// rows [T, H, D] quantized into the int8 cache [num_blocks, block_size, H, D] at slot_mapping [T], with
// `scales` (kv_int8.h): static ones divide, dynamic ones are computed per token and head and written to
// `row_scales` (the scale cache, [num_blocks, block_size, H]).
template <typename scalar_t>
void quantize_rows(const torch::Tensor& rows, torch::Tensor& cache, const infer_recipes::CacheScales& scales,
                   float* row_scales, const int64_t* slots, int64_t begin, int64_t end) {
  const int64_t heads = rows.size(1), head_dim = rows.size(2);
  const scalar_t* source = rows.data_ptr<scalar_t>();
  int8_t* target = cache.data_ptr<int8_t>();
  for (int64_t t = begin; t < end; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const scalar_t* x = source + t * rows.stride(0) + h * rows.stride(1);
      const int64_t row = slots[t] * heads + h;
      int8_t* q = target + row * head_dim;
      if (scales.per_channel) {
        const float* channel = scales.per_channel + h * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) {
          const float scaled = std::clamp(static_cast<float>(x[d]) / channel[d], -128.0f, 127.0f);
          q[d] = static_cast<int8_t>(std::nearbyint(scaled));
        }
        continue;
      }
      float abs_max = 0.0f;
      for (int64_t d = 0; d < head_dim; ++d) abs_max = std::max(abs_max, std::fabs(static_cast<float>(x[d])));
      float scale = abs_max / 127.5f;
      scale = scale == 0.0f ? FLT_EPSILON : scale;
      row_scales[row] = scale;
      for (int64_t d = 0; d < head_dim; ++d) {
        const float scaled = std::clamp(static_cast<float>(x[d]) / scale, -128.0f, 127.0f);
        q[d] = static_cast<int8_t>(std::nearbyint(scaled));
      }
    }
  }
}

// write_rows for int8 caches: each source quantized into its cache, each with its scale tensor.
void write_quantized_rows(const std::vector<torch::Tensor>& sources, std::vector<torch::Tensor> caches,
                          const std::vector<torch::Tensor>& scale_tensors, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be a contiguous int64 vector");
  const int64_t tokens = slot_mapping.size(0);
  const int64_t num_slots = caches[0].size(0) * caches[0].size(1);
  std::vector<infer_recipes::CacheScales> scales;
  for (size_t i = 0; i < sources.size(); ++i) {
    check_rows_fit_cache(sources[i], caches[i]);
    TORCH_CHECK(sources[i].dim() == 3 && sources[i].stride(2) == 1 && sources[i].size(0) == tokens,
                "rows [T, H, D] with contiguous D, one slot per row, expected");
    TORCH_CHECK(caches[i].size(0) * caches[i].size(1) == num_slots, "caches of one shape expected");
    scales.push_back(infer_recipes::cache_scales(caches[i], scale_tensors[i]));
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const auto [lowest, highest] = std::minmax_element(slots, slots + tokens);
  TORCH_CHECK(tokens == 0 || (*lowest >= 0 && *highest < num_slots), "slot_mapping must lie in [0, ", num_slots,
              "), got slots from ", *lowest, " to ", *highest);
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < sources.size(); ++i) {
      float* row_scales = scales[i].per_row ? scale_tensors[i].data_ptr<float>() : nullptr;
      AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, sources[i].scalar_type(), "write_kv_cache", [&] {
        quantize_rows<scalar_t>(sources[i], caches[i], scales[i], row_scales, slots, begin, end);
      });
    }
  });
}

}  // namespace

// key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]; int8
// caches come with their scales (kv_int8.h).
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                    torch::Tensor slot_mapping, c10::optional<torch::Tensor> key_scale,
                    c10::optional<torch::Tensor> value_scale) {
  if (key_cache.scalar_type() != torch::kChar) {
    TORCH_CHECK(!key_scale.has_value() && !value_scale.has_value(), "scales are for an int8 KV cache only");
    write_rows({key, value}, {key_cache, value_cache}, slot_mapping);
    return;
  }
  TORCH_CHECK(key_scale.has_value() && value_scale.has_value(), "an int8 KV cache needs its key and value scales");
  write_quantized_rows({key, value}, {key_cache, value_cache}, {*key_scale, *value_scale}, slot_mapping);
}

// latent [T, L] into latent_cache [num_blocks, block_size, L] at slot_mapping [T]; an int8 cache comes with its
// scale ([num_blocks, block_size, 1] per token, or [1, L] per channel), the latent quantized as one head.
void write_latent_cache(torch::Tensor latent, torch::Tensor latent_cache, torch::Tensor slot_mapping,
                        c10::optional<torch::Tensor> latent_scale) {
  if (latent_cache.scalar_type() != torch::kChar) {
    TORCH_CHECK(!latent_scale.has_value(), "a scale is for an int8 latent cache only");
    write_rows({latent}, {latent_cache}, slot_mapping);
    return;
  }
  TORCH_CHECK(latent_scale.has_value(), "an int8 latent cache needs its scale");
  write_quantized_rows({latent.unsqueeze(1)}, {latent_cache.unsqueeze(2)}, {*latent_scale}, slot_mapping);
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
        "Tensor(c!)? key_scale, Tensor(d!)? value_scale) -> ()");
  m.def("write_latent_cache(Tensor latent, Tensor(a!) latent_cache, Tensor slot_mapping, Tensor(b!)? latent_scale) -> ()");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("write_kv_cache", &write_kv_cache);
  m.impl("write_latent_cache", &write_latent_cache);
}
