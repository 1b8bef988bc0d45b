// Attention of every non-decode step (prefill, chunked prefill, prefill after a prefix-cache hit, verify
// steps) for the CPU, in one call for the whole step. Each request's keys at [kv_len - q_len, kv_len) are
// read from the step's own key/value tensors (what the layer has just written to the cache), only the cached
// prefix before them from the paged cache. Work items are (request, KV head, tile of query tokens): the
// tile's rows (its tokens x the query heads of that KV head) run a blocked online softmax over tiles of
// keys, so each key and value row serves every row of the tile. Rows lie along vector lanes (the queries
// transposed once per item), so keys and values are read in place, and the softmax runs across rows.
// Accumulates in fp32 whatever the storage dtype. With an int8 cache (C8) every key is read from the cache,
// the step's own too (dequantized as read, kv_int8.h), so that a token attends alike whether its keys came
// this step or from a cached prefix.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "cpu_math.h"
#include "kv_int8.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

// A named namespace: every source is compiled into one translation unit (ops/cpu_kernels.py).
namespace infer_recipes::prefill {

constexpr int64_t kKeyTile = 32;   // keys per score tile
constexpr int64_t kRowBlock = 32;  // rows (query tokens x grouped heads) come in blocks of 32, the last padded
// The score of a key a row may not see: finite, so a row that has seen no key yet gets no NaN; its weights
// then vanish at the first key it sees (the correction exp(kMasked - max) is 0).
constexpr float kMasked = -1e30f;

// Read-only description of the step, shared by every work item.
template <typename scalar_t, typename cache_t>
struct Step {
  const scalar_t* query;
  const scalar_t* key;
  const scalar_t* value;
  const cache_t* key_cache;
  const cache_t* value_cache;
  CacheScales key_scales, value_scales;  // an int8 cache's (cache_t int8_t)
  const int32_t* block_table;
  const int64_t* query_ends;
  const int64_t* seq_lens;
  const float* sinks;  // [H] or nullptr
  scalar_t* out;
  int64_t query_token_stride, query_head_stride, kv_token_stride, kv_head_stride;
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, table_width, sliding_window;
  float scale;
};

// A cache's storage type as a value, to pick a kernel instance at run time.
template <typename T>
struct Storage {
  using type = T;
};

// One work item: `num_tokens` query tokens of request `request` from its token `first_token` on.
struct Tile {
  int64_t request, first_token, num_tokens;
};

// Rows of values and accumulators are read as whole vectors: a head dim no multiple of 8 is padded (with
// zeros) in the buffers.
inline int64_t padded(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// A row as fp32: fp32 storage whose rows are whole vectors is read in place, anything else converted into
// `buffer` (whose padding stays zero).
template <typename scalar_t>
inline const float* as_float(const scalar_t* source, float* buffer, int64_t head_dim) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    if (head_dim % 8 == 0) return source;
  }
  for (int64_t d = 0; d < head_dim; ++d) buffer[d] = static_cast<float>(source[d]);
  return buffer;
}

// Per-thread buffers, sized for the largest tile.
struct Scratch {
  int64_t row_stride, value_stride;
  std::vector<float> queries_t, scores, accumulators, running_max, denominator, key_buffer, value_buffer;
  std::vector<int64_t> row_positions;
  const float* key_rows[kKeyTile];
  const float* value_rows[kKeyTile];
  Scratch(int64_t rows, int64_t head_dim)
      : row_stride(padded(rows, kRowBlock)), value_stride(padded(head_dim, 8)),
        queries_t(head_dim * row_stride), scores(kKeyTile * row_stride), accumulators(row_stride * value_stride),
        running_max(row_stride), denominator(row_stride), key_buffer(kKeyTile * value_stride),
        value_buffer(kKeyTile * value_stride), row_positions(rows) {}
};

// Points the scratch's key and value rows at positions [start, start + n) of one request and KV head: the
// step's tensors for the positions it computed, the cache blocks for the prefix before them (for all of
// them with an int8 cache).
template <typename scalar_t, typename cache_t>
void locate_kv(const Step<scalar_t, cache_t>& step, int64_t request, int64_t kv_head, int64_t start, int64_t n,
               Scratch& scratch) {
  const int64_t query_start = request == 0 ? 0 : step.query_ends[request - 1];
  constexpr bool quantized = std::is_same_v<cache_t, int8_t>;
  const int64_t fresh_start = step.seq_lens[request] - (quantized ? 0 : step.query_ends[request] - query_start);
  const int32_t* blocks = step.block_table + request * step.table_width;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t position = start + t;
    const bool fresh = position >= fresh_start;
    float* key_buffer = scratch.key_buffer.data() + t * scratch.value_stride;
    float* value_buffer = scratch.value_buffer.data() + t * scratch.value_stride;
    if (fresh) {  // keys and values share their layout
      const int64_t offset = (query_start + position - fresh_start) * step.kv_token_stride + kv_head * step.kv_head_stride;
      scratch.key_rows[t] = as_float(step.key + offset, key_buffer, step.head_dim);
      scratch.value_rows[t] = as_float(step.value + offset, value_buffer, step.head_dim);
    } else {
      const int64_t slot = static_cast<int64_t>(blocks[position / step.block_size]) * step.block_size +
                           position % step.block_size;
      const int64_t row = slot * step.num_kv_heads + kv_head;
      // Rows are read as whole vectors: fp32 rows in place only where the head dim is a multiple of 8.
      const bool in_place = step.head_dim % 8 == 0;
      scratch.key_rows[t] = cached_row(step.key_cache, row, step.head_dim, step.key_scales, key_buffer, in_place);
      scratch.value_rows[t] =
          cached_row(step.value_cache, row, step.head_dim, step.value_scales, value_buffer, in_place);
    }
  }
}

// scores[t, r:r + 16] = key_rows[t] . queries_t[:, r:r + 16] for kKeys keys at once: kKeys x 2 vectors of
// sums held in registers, each loaded query vector used by every key.
template <int64_t kKeys, int64_t kHeadDim>
inline void score_keys(const float* const* key_rows, const float* queries_t, float* scores, int64_t head_dim,
                       int64_t row_stride) {
  const int64_t dims = kHeadDim > 0 ? kHeadDim : head_dim;
  float8 sums[kKeys][2] = {};
  for (int64_t d = 0; d < dims; ++d) {
    const float8 low = load8(queries_t + d * row_stride), high = load8(queries_t + d * row_stride + 8);
    for (int64_t k = 0; k < kKeys; ++k) {
      const float8 key = broadcast8(key_rows[k][d]);
      sums[k][0] += key * low;
      sums[k][1] += key * high;
    }
  }
  for (int64_t k = 0; k < kKeys; ++k) {
    store8(scores + k * row_stride, sums[k][0]);
    store8(scores + k * row_stride + 8, sums[k][1]);
  }
}

// Scores of n keys for every row, four keys by sixteen rows at a time.
template <int64_t kHeadDim>
void score_tile(const Scratch& scratch, float* scores, int64_t n, int64_t head_dim) {
  const int64_t stride = scratch.row_stride;
  for (int64_t rows = 0; rows < stride; rows += 16) {
    const float* queries_t = scratch.queries_t.data() + rows;
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
      score_keys<4, kHeadDim>(scratch.key_rows + t, queries_t, scores + t * stride + rows, head_dim, stride);
    }
    for (; t < n; ++t) {
      score_keys<1, kHeadDim>(scratch.key_rows + t, queries_t, scores + t * stride + rows, head_dim, stride);
    }
  }
}

// Sets the scores of keys [start, start + n) that a row may not see to kMasked; row r is a query at
// position row_positions[r].
void mask_tile(float* scores, const int64_t* row_positions, int64_t rows, int64_t row_stride, int64_t sliding_window,
               int64_t start, int64_t n) {
  for (int64_t t = 0; t < n; ++t) {
    const int64_t key = start + t;
    float* s = scores + t * row_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const bool visible = key <= row_positions[r] && (sliding_window <= 0 || key > row_positions[r] - sliding_window);
      s[r] = visible ? s[r] : kMasked;
    }
  }
}

inline float8 max8(float8 a, float8 b) { return a > b ? a : b; }

// Row r's running max moves up to new_max: its denominator and accumulator shrink by exp(old - new), which
// is 0 while it has nothing accumulated.
inline void rescale_row(Scratch& scratch, int64_t r, float new_max) {
  const float correction = std::exp(scratch.running_max[r] - new_max);
  scratch.running_max[r] = new_max;
  if (correction == 1.0f) return;
  scratch.denominator[r] *= correction;
  float* accumulator = scratch.accumulators.data() + r * scratch.value_stride;
  for (int64_t d = 0; d < scratch.value_stride; ++d) accumulator[d] *= correction;
}

// The online softmax of every row at once, eight rows per vector: scores of n keys become weights, and
// each row's running max, denominator and accumulator move on.
void softmax_tile(float* scores, int64_t n, Scratch& scratch) {
  const int64_t stride = scratch.row_stride;
  for (int64_t row = 0; row < stride; row += 8) {
    float8 new_max = load8(scratch.running_max.data() + row);
    for (int64_t t = 0; t < n; ++t) new_max = max8(new_max, load8(scores + t * stride + row));
    for (int64_t t = 0; t < n; ++t) store8(scores + t * stride + row, load8(scores + t * stride + row) - new_max);
    for (int64_t lane = 0; lane < 8; ++lane) rescale_row(scratch, row + lane, new_max[lane]);
  }
  exp_nonpositive(scores, n * stride);
  for (int64_t row = 0; row < stride; row += 8) {
    float8 denominator = load8(scratch.denominator.data() + row);
    for (int64_t t = 0; t < n; ++t) denominator += load8(scores + t * stride + row);
    store8(scratch.denominator.data() + row, denominator);
  }
}

// accumulators[r + i, c:c + 8 kVectors] += sum_t weights[t, r + i] values[t, c:c + 8 kVectors] for i < kRows:
// the sums held in registers, each loaded value vector used by every row.
template <int64_t kRows, int64_t kVectors>
inline void accumulate_block(const float* weights, const float* const* value_rows, float* accumulators, int64_t n,
                             int64_t row_stride, int64_t value_stride, int64_t column) {
  float8 sums[kRows][kVectors];
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t v = 0; v < kVectors; ++v) sums[i][v] = load8(accumulators + i * value_stride + 8 * v);
  }
  for (int64_t t = 0; t < n; ++t) {
    float8 value[kVectors];
    for (int64_t v = 0; v < kVectors; ++v) value[v] = load8(value_rows[t] + column + 8 * v);
    for (int64_t i = 0; i < kRows; ++i) {
      const float8 w = broadcast8(weights[t * row_stride + i]);
      for (int64_t v = 0; v < kVectors; ++v) sums[i][v] += w * value[v];
    }
  }
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t v = 0; v < kVectors; ++v) store8(accumulators + i * value_stride + 8 * v, sums[i][v]);
  }
}

// Every row's accumulator += its weights times the value rows, four rows by two vectors of columns at a time.
void accumulate_tile(const float* weights, int64_t n, Scratch& scratch) {
  const int64_t row_stride = scratch.row_stride, value_stride = scratch.value_stride;
  for (int64_t r = 0; r < row_stride; r += 4) {
    float* accumulators = scratch.accumulators.data() + r * value_stride;
    int64_t column = 0;
    for (; column + 16 <= value_stride; column += 16) {
      accumulate_block<4, 2>(weights + r, scratch.value_rows, accumulators + column, n, row_stride, value_stride,
                             column);
    }
    if (column < value_stride) {
      accumulate_block<4, 1>(weights + r, scratch.value_rows, accumulators + column, n, row_stride, value_stride,
                             column);
    }
  }
}

template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void attend_tile(const Step<scalar_t, cache_t>& step, const Tile& tile, int64_t kv_head, Scratch& scratch) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : step.head_dim, group = step.group;
  const int64_t rows = tile.num_tokens * group, stride = scratch.row_stride;
  const int64_t query_start = tile.request == 0 ? 0 : step.query_ends[tile.request - 1];
  const int64_t q_len = step.query_ends[tile.request] - query_start;
  const int64_t first_position = step.seq_lens[tile.request] - q_len + tile.first_token;
  const int64_t last_position = first_position + tile.num_tokens - 1;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // Row r is token r / group, head kv_head * group + r % group; rows past `rows` stay zero and are not written.
  std::fill(scratch.queries_t.begin(), scratch.queries_t.end(), 0.0f);
  std::fill(scratch.accumulators.begin(), scratch.accumulators.end(), 0.0f);
  std::fill(scratch.running_max.begin(), scratch.running_max.end(), neg_inf);
  std::fill(scratch.denominator.begin(), scratch.denominator.end(), 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = query_start + tile.first_token + r / group, head = kv_head * group + r % group;
    const scalar_t* q = step.query + token * step.query_token_stride + head * step.query_head_stride;
    for (int64_t d = 0; d < head_dim; ++d) scratch.queries_t[d * stride + r] = static_cast<float>(q[d]) * step.scale;
    scratch.row_positions[r] = first_position + r / group;
    if (step.sinks) {  // one more logit in the denominator, whose value row is zero
      scratch.running_max[r] = step.sinks[head];
      scratch.denominator[r] = 1.0f;
    }
  }
  const int64_t window = step.sliding_window;
  const int64_t keys_begin = window > 0 ? std::max<int64_t>(0, first_position - window + 1) : 0;
  for (int64_t start = keys_begin; start <= last_position; start += kKeyTile) {
    const int64_t n = std::min(kKeyTile, last_position + 1 - start);
    locate_kv(step, tile.request, kv_head, start, n, scratch);
    float* scores = scratch.scores.data();
    score_tile<kHeadDim>(scratch, scores, n, head_dim);
    // Masks only where the first token does not see the last key, or the last token not the first one.
    if (start + n - 1 > first_position || (window > 0 && start <= last_position - window)) {
      mask_tile(scores, scratch.row_positions.data(), rows, stride, window, start, n);
    }
    softmax_tile(scores, n, scratch);
    accumulate_tile(scores, n, scratch);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = query_start + tile.first_token + r / group, head = kv_head * group + r % group;
    scalar_t* out = step.out + (token * step.num_heads + head) * head_dim;
    const float* accumulator = scratch.accumulators.data() + r * scratch.value_stride;
    const float inverse = 1.0f / scratch.denominator[r];
    for (int64_t d = 0; d < head_dim; ++d) out[d] = static_cast<scalar_t>(accumulator[d] * inverse);
  }
}

// The step's tiles, the most keys first, so that the threads, taking the next tile as they finish one,
// end together.
std::vector<Tile> plan_tiles(const int64_t* query_ends, const int64_t* seq_lens, int64_t batch, int64_t tokens_per_tile) {
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_len = query_ends[b] - (b == 0 ? 0 : query_ends[b - 1]);
    for (int64_t first = 0; first < q_len; first += tokens_per_tile) {
      tiles.push_back({b, first, std::min(tokens_per_tile, q_len - first)});
    }
  }
  const auto keys_end = [&](const Tile& tile) {
    const int64_t q_len = query_ends[tile.request] - (tile.request == 0 ? 0 : query_ends[tile.request - 1]);
    return seq_lens[tile.request] - q_len + tile.first_token + tile.num_tokens;
  };
  std::stable_sort(tiles.begin(), tiles.end(),
                   [&](const Tile& a, const Tile& b) { return keys_end(a) > keys_end(b); });
  return tiles;
}

template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void prefill_attention(const Step<scalar_t, cache_t>& step, int64_t batch) {
  const int64_t tokens_per_tile = std::max<int64_t>(1, kRowBlock / step.group);
  const std::vector<Tile> tiles = plan_tiles(step.query_ends, step.seq_lens, batch, tokens_per_tile);
  const int64_t num_items = static_cast<int64_t>(tiles.size()) * step.num_kv_heads;
  std::atomic<int64_t> next_item{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch(tokens_per_tile * step.group, step.head_dim);
    for (int64_t item = next_item++; item < num_items; item = next_item++) {
      attend_tile<scalar_t, cache_t, kHeadDim>(step, tiles[item / step.num_kv_heads], item % step.num_kv_heads, scratch);
    }
  });
}

}  // namespace infer_recipes::prefill

torch::Tensor paged_prefill_attention(torch::Tensor query, torch::Tensor key, torch::Tensor value,
                                      torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor block_table,
                                      torch::Tensor query_ends, torch::Tensor seq_lens, double scale,
                                      int64_t sliding_window, c10::optional<torch::Tensor> sinks,
                                      c10::optional<torch::Tensor> key_scale, c10::optional<torch::Tensor> value_scale) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key_cache.dim() == 4,
              "query [T, H, D], key/value [T, Hkv, D] and caches [N, block, Hkv, D] expected");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(key.sizes() == value.sizes() && key.size(0) == query.size(0) && key.sizes().slice(1) == key_cache.sizes().slice(2),
              "key/value must be [T, Hkv, D] for the query's T and the cache's Hkv, D");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() && key_cache.scalar_type() == value_cache.scalar_type() &&
                  (key.scalar_type() == key_cache.scalar_type() || key_cache.scalar_type() == torch::kChar),
              "query, key/value and the caches must share a dtype, or the caches be int8");
  const infer_recipes::CacheScales key_scales = infer_recipes::cache_scales(key_cache, key_scale);
  const infer_recipes::CacheScales value_scales = infer_recipes::cache_scales(value_cache, value_scale);
  const bool quantized = key_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && query_ends.scalar_type() == torch::kInt64 &&
                  seq_lens.scalar_type() == torch::kInt64,
              "block_table int32, query_ends and seq_lens int64 expected");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must group over KV heads");
  if (query.stride(2) != 1) query = query.contiguous();
  if (key.stride(2) != 1 || key.strides() != value.strides()) {  // the kernel reads both with one set of strides
    key = key.contiguous();
    value = value.contiguous();
  }
  block_table = block_table.contiguous();
  query_ends = query_ends.contiguous();
  seq_lens = seq_lens.contiguous();
  torch::Tensor sink_logits;
  if (sinks.has_value()) sink_logits = sinks->to(torch::kFloat32).contiguous();
  auto out = torch::empty(query.sizes(), query.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_prefill_attention", [&] {
    const auto run = [&](auto cache_type, auto head_dim) {
      using cache_t = typename decltype(cache_type)::type;
      const infer_recipes::prefill::Step<scalar_t, cache_t> step{
          query.data_ptr<scalar_t>(), key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(),
          key_cache.data_ptr<cache_t>(), value_cache.data_ptr<cache_t>(), key_scales, value_scales,
          block_table.data_ptr<int32_t>(), query_ends.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
          sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr, out.data_ptr<scalar_t>(),
          query.stride(0), query.stride(1), key.stride(0), key.stride(1),
          query.size(1), key_cache.size(2), query.size(1) / key_cache.size(2), query.size(2), key_cache.size(1),
          block_table.size(1), sliding_window, static_cast<float>(scale)};
      infer_recipes::prefill::prefill_attention<scalar_t, cache_t, decltype(head_dim)::value>(step, query_ends.size(0));
    };
    const auto with_cache = [&](auto head_dim) {
      if (quantized) {
        run(infer_recipes::prefill::Storage<int8_t>{}, head_dim);
      } else {
        run(infer_recipes::prefill::Storage<scalar_t>{}, head_dim);
      }
    };
    switch (query.size(2)) {
      case 64: with_cache(std::integral_constant<int64_t, 64>{}); break;
      case 128: with_cache(std::integral_constant<int64_t, 128>{}); break;
      default: with_cache(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor key, Tensor value, Tensor key_cache, "
        "Tensor value_cache, Tensor block_table, Tensor query_ends, Tensor seq_lens, float scale, int sliding_window, "
        "Tensor? sinks, Tensor? key_scale, Tensor? value_scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
