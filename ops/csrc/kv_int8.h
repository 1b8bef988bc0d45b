// The int8 KV cache (C8) for the CPU kernels: where a cache's scales are, and one cached row read back
// as fp32. A scale tensor's rank says its kind (ops/quant_math.py): [num_blocks, block_size, Hkv] holds one
// scale per slot and KV head (dynamic), [Hkv, D] one per channel (static, from the checkpoint).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

namespace infer_recipes {

struct CacheScales {
  const float* per_row = nullptr;      // [num_slots * num_kv_heads]: row slot * Hkv + head
  const float* per_channel = nullptr;  // [num_kv_heads * head_dim]
  int64_t num_kv_heads = 1;
};

// The scales of `cache` [num_blocks, block_size, Hkv, D] from its optional scale tensor; none for a float
// cache, and an int8 cache must have them.
inline CacheScales cache_scales(const torch::Tensor& cache, const c10::optional<torch::Tensor>& scale) {
  const bool quantized = cache.scalar_type() == torch::kChar;
  TORCH_CHECK(quantized == scale.has_value(), "an int8 KV cache needs its scales, and only it");
  CacheScales scales;
  if (!quantized) return scales;
  const torch::Tensor& s = *scale;
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.is_contiguous(), "KV cache scales must be contiguous fp32");
  scales.num_kv_heads = cache.size(2);
  if (s.dim() == 3) {
    TORCH_CHECK(s.size(0) == cache.size(0) && s.size(1) == cache.size(1) && s.size(2) == cache.size(2),
                "per-token scales must be [num_blocks, block_size, Hkv] of their cache, got ", s.sizes());
    scales.per_row = s.data_ptr<float>();
  } else {
    TORCH_CHECK(s.dim() == 2 && s.size(0) == cache.size(2) && s.size(1) == cache.size(3),
                "per-channel scales must be [Hkv, D] of their cache, got ", s.sizes());
    scales.per_channel = s.data_ptr<float>();
  }
  return scales;
}

// Row `row` (slot * Hkv + head) of a cache as fp32: read in place where it is fp32 already (and `in_place`
// allows), else converted into `buffer`; int8 values times the row's scale, then the channel's.
template <typename cache_t>
inline const float* cached_row(const cache_t* cache, int64_t row, int64_t head_dim, const CacheScales& scales,
                               float* buffer, bool in_place = true) {
  const cache_t* values = cache + row * head_dim;
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    const float row_scale = scales.per_row ? scales.per_row[row] : 1.0f;
    if (scales.per_channel) {
      const float* channel = scales.per_channel + (row % scales.num_kv_heads) * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(values[d]) * row_scale * channel[d];
    } else {
      for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(values[d]) * row_scale;
    }
    return buffer;
  } else {
    if constexpr (std::is_same_v<cache_t, float>) {
      if (in_place) return values;
    }
    for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(values[d]);
    return buffer;
  }
}

}  // namespace infer_recipes
