// Decode attention over the paged KV cache for the CPU: one query token per request, read straight
// from the cache blocks (no gathered copy), one pass with an online softmax, so the work follows the
// K/V each request actually has. Parallel over (request, KV head); all query heads of a KV head share
// each loaded key and value row, a tile of keys at a time. Accumulates in fp32 whatever the storage dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// A row as fp32: fp32 storage is read in place, other dtypes are converted into `buffer`.
template <typename scalar_t>
inline const float* as_float(const scalar_t* source, float* buffer, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    return source;
  } else {
    for (int64_t d = 0; d < n; ++d) buffer[d] = static_cast<float>(source[d]);
    return buffer;
  }
}

// Positions attended per tile: their scores are computed together, then their weights, then the
// value rows are accumulated, so that no step waits on the one before (the one-key-at-a-time
// online softmax is bound by that chain).
constexpr int64_t kTile = 32;

// kHeadDim > 0: the head dim known when compiling (64, 128), so the per-key loops unroll; 0: any.
template <typename scalar_t, int64_t kHeadDim>
void decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                      const torch::Tensor& block_table, const torch::Tensor& seq_lens, const float* sinks, double scale,
                      int64_t sliding_window, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_table.size(1);
  const scalar_t* q = query.data_ptr<scalar_t>();
  const scalar_t* keys = key_cache.data_ptr<scalar_t>();
  const scalar_t* values = value_cache.data_ptr<scalar_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_rows(group * head_dim), acc(group * head_dim), scores(group * kTile);
    std::vector<float> k_rows(kTile * head_dim), v_rows(kTile * head_dim);
    std::vector<float> running_max(group), denominator(group);
    const float* k_tile[kTile];
    const float* v_tile[kTile];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t length = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, length - sliding_window) : 0;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t head = kv_head * group + g;
        const scalar_t* q_row = q + (b * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_rows[g * head_dim + d] = static_cast<float>(q_row[d]) * static_cast<float>(scale);
        // A sink is one more logit in the denominator whose value row is zero.
        running_max[g] = sinks ? sinks[head] : neg_inf;
        denominator[g] = sinks ? 1.0f : 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t tile_start = first; tile_start < length; tile_start += kTile) {
        const int64_t n = std::min(kTile, length - tile_start);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t pos = tile_start + t;
          const int64_t slot = static_cast<int64_t>(table[b * table_width + pos / block_size]) * block_size + pos % block_size;
          const int64_t offset = (slot * num_kv_heads + kv_head) * head_dim;
          k_tile[t] = as_float(keys + offset, k_rows.data() + t * head_dim, head_dim);
          v_tile[t] = as_float(values + offset, v_rows.data() + t * head_dim, head_dim);
          for (int64_t g = 0; g < group; ++g) scores[g * kTile + t] = infer_recipes::dot(q_rows.data() + g * head_dim, k_tile[t], head_dim);
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * kTile;
          const float tile_max = *std::max_element(s, s + n);
          const float new_max = std::max(running_max[g], tile_max);
          const float correction = std::exp(running_max[g] - new_max);  // 0 while nothing is accumulated
          for (int64_t t = 0; t < n; ++t) s[t] -= new_max;
          infer_recipes::exp_nonpositive(s, n);
          float tile_sum = 0.0f;
          for (int64_t t = 0; t < n; ++t) tile_sum += s[t];
          denominator[g] = denominator[g] * correction + tile_sum;
          running_max[g] = new_max;
          if (correction != 1.0f) {
            float* a = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          }
        }
        for (int64_t t = 0; t < n; ++t) {
          const float* v = v_tile[t];
          for (int64_t g = 0; g < group; ++g) {
            const float weight = scores[g * kTile + t];
            float* a = acc.data() + g * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * v[d];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* row = o + (b * num_heads + kv_head * group + g) * head_dim;
        const float inverse = 1.0f / denominator[g];
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<scalar_t>(acc[g * head_dim + d] * inverse);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                     int64_t sliding_window, c10::optional<torch::Tensor> sinks) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D] and caches [N, block, Hkv, D] expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64,
              "block_table int32 and seq_lens int64 expected");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must group over KV heads");
  query = query.contiguous();
  block_table = block_table.contiguous();
  seq_lens = seq_lens.contiguous();
  torch::Tensor sink_logits;
  if (sinks.has_value()) sink_logits = sinks->to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const float* sink_data = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
    const auto run = [&](auto head_dim) {
      decode_attention<scalar_t, decltype(head_dim)::value>(query, key_cache, value_cache, block_table, seq_lens,
                                                            sink_data, scale, sliding_window, out);
    };
    switch (query.size(2)) {
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}
