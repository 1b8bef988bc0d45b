// Decode attention over the paged KV cache for the CPU: one query token per row, read straight from
// the cache blocks (no gathered copy), so the work follows the K/V each request actually has. Parallel
// over (request, KV head); all query heads of a KV head, and all rows of a request (a verify step's
// 1 + k tokens), share each loaded key and value row. The positions go by chunks of up to kChunk: the
// chunk's scores a tile of keys at a time, one softmax pass over them per query vector, then its value
// sums a tile at a time; an online softmax carries the sums from chunk to chunk. The next tile's rows
// are prefetched meanwhile, and a chunk's rows are looked up in the block table once.
// With AVX-512 (head dims that are multiples of 16, chosen at run time) or AVX2 (multiples of 8) the
// tile's scores and value sums run in intrinsics, portable loops otherwise; the softmax runs in
// loops the compiler vectorises. Accumulates in fp32 whatever the storage dtype; an int8 cache (C8) is
// dequantized row by row as it is read (kv_int8.h), so the kernel streams a quarter of fp32's bytes.
// A bf16 cache on a CPU with AMX takes amx_decode_attention.cpp's tile products instead (head dims
// 64 and 128).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "amx_decode_attention.h"
#include "cpu_math.h"
#include "cpu_math_avx512.h"
#include "kv_int8.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Key or value rows read together (converted to fp32 together where the cache is not): 32 x head dim
// floats stay in L1.
constexpr int64_t kTile = 32;
// Positions whose scores are held together, so that each query vector's softmax is one pass over them
// (per 32-key tile, a verify step's 12 vectors spent a fifth of the kernel in softmax calls and
// rescaling); 256 x 4 bytes a vector stay in L2 even for 16 heads over 8 rows.
constexpr int64_t kChunk = 256;

// Asks for a row's cache lines ahead of use: consecutive positions sit in different blocks, which
// the hardware prefetcher cannot guess, and one item's walk alone leaves memory idle between misses.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* start = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset);
}

#ifdef __AVX2__
// {sum of a[0]'s lanes, ..., sum of a[7]'s lanes}: eight dot products finished in one vector.
inline __m256 lane_sums(const __m256 a[8]) {
  const __m256 pairs01 = _mm256_hadd_ps(a[0], a[1]), pairs23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 pairs45 = _mm256_hadd_ps(a[4], a[5]), pairs67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 quads0123 = _mm256_hadd_ps(pairs01, pairs23), quads4567 = _mm256_hadd_ps(pairs45, pairs67);
  // Each 128-bit half holds a partial sum of four rows: add the low halves to the high ones.
  return _mm256_add_ps(_mm256_permute2f128_ps(quads0123, quads4567, 0x20),
                       _mm256_permute2f128_ps(quads0123, quads4567, 0x31));
}

// scores[j] = q . keys[j] for eight key rows (head_dim a multiple of 8): one accumulator per key,
// so eight independent FMA chains, and the query chunk loaded once for all eight.
inline void scores_of_8_keys(const float* q, const float* const* keys, int64_t head_dim, float* scores) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < head_dim; d += 8) {
    const __m256 q_chunk = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(q_chunk, _mm256_loadu_ps(keys[j] + d), acc[j]);
  }
  _mm256_storeu_ps(scores, lane_sums(acc));
}

// acc[0, 8 kVectors) += sum over t < n of weights[t] * rows[t][offset, offset + 8 kVectors), the
// accumulators held in registers over the whole tile.
template <int kVectors>
inline void accumulate_rows(const float* weights, const float* const* rows, int64_t n, int64_t offset, float* acc) {
  __m256 sum[kVectors];
  for (int j = 0; j < kVectors; ++j) sum[j] = _mm256_loadu_ps(acc + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 weight = _mm256_broadcast_ss(weights + t);
    const float* row = rows[t] + offset;
    for (int j = 0; j < kVectors; ++j) sum[j] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(row + 8 * j), sum[j]);
  }
  for (int j = 0; j < kVectors; ++j) _mm256_storeu_ps(acc + 8 * j, sum[j]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
namespace avx512_attention {

// {sum of a[0]'s lanes, ..., sum of a[15]'s lanes}: sixteen dot products finished in one vector, by four
// levels of shuffles and adds (each level halves the vectors and doubles what a lane sums).
__attribute__((target("avx512f"))) inline __m512 lane_sums(const __m512 a[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: {a[2i] 0+2, a[2i+1] 0+2, a[2i] 1+3, a[2i+1] 1+3}
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: a[4i .. 4i+3], each summed over its four lanes
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // The 128-bit lanes of quads[i] hold partial sums of the same four rows: fold them together.
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// The tile's scores as tile_scores below, sixteen keys at a time (head_dim a multiple of 16; k_tile
// padded to a multiple of 16 with its last row).
__attribute__((target("avx512f"))) void tile_scores(const float* q_rows, int64_t vectors, int64_t head_dim,
                                                    const float** k_tile, int64_t n, float* scores, int64_t stride) {
  for (int64_t t = n; t % 16 != 0; ++t) k_tile[t] = k_tile[n - 1];
  for (int64_t t = 0; t < n; t += 16) {
    const float* const* keys = k_tile + t;
    for (int64_t g = 0; g < vectors; ++g) {
      const float* q = q_rows + g * head_dim;
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
      for (int64_t d = 0; d < head_dim; d += 16) {
        const __m512 q_chunk = _mm512_loadu_ps(q + d);
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(q_chunk, _mm512_loadu_ps(keys[j] + d), acc[j]);
      }
      _mm512_storeu_ps(scores + g * stride + t, lane_sums(acc));
    }
  }
}

// acc[g][offset, offset + 16 kChunks) += sum over t < n of weights[g][t] * rows[t][...] for kVectors query
// vectors g at once: each loaded value chunk serves all of them, the sums held in registers.
template <int kVectors, int kChunks>
__attribute__((target("avx512f"))) inline void accumulate(const float* weights, int64_t stride, const float* const* rows,
                                                          int64_t n, int64_t offset, float* acc, int64_t head_dim) {
  __m512 sum[kVectors][kChunks];
  for (int g = 0; g < kVectors; ++g) {
    for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_loadu_ps(acc + g * head_dim + offset + 16 * c);
  }
  for (int64_t t = 0; t < n; ++t) {
    __m512 value[kChunks];
    for (int c = 0; c < kChunks; ++c) value[c] = _mm512_loadu_ps(rows[t] + offset + 16 * c);
    for (int g = 0; g < kVectors; ++g) {
      const __m512 weight = _mm512_set1_ps(weights[g * stride + t]);
      for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_fmadd_ps(weight, value[c], sum[g][c]);
    }
  }
  for (int g = 0; g < kVectors; ++g) {
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + g * head_dim + offset + 16 * c, sum[g][c]);
  }
}

// Up to kVectors query vectors over `chunks` (1 to 4) 16-float chunks from `offset`.
template <int kVectors>
__attribute__((target("avx512f"))) inline void accumulate_chunks(int64_t chunks, const float* weights, int64_t stride,
                                                                 const float* const* rows, int64_t n, int64_t offset,
                                                                 float* acc, int64_t head_dim) {
  switch (chunks) {
    case 4: return accumulate<kVectors, 4>(weights, stride, rows, n, offset, acc, head_dim);
    case 3: return accumulate<kVectors, 3>(weights, stride, rows, n, offset, acc, head_dim);
    case 2: return accumulate<kVectors, 2>(weights, stride, rows, n, offset, acc, head_dim);
    default: return accumulate<kVectors, 1>(weights, stride, rows, n, offset, acc, head_dim);
  }
}

// The tile's value sums as tile_values below: six query vectors by 64 floats a pass (24 accumulators of
// the 32 registers), so each value row is loaded once per six vectors (head_dim a multiple of 16).
__attribute__((target("avx512f"))) void tile_values(const float* weights, int64_t stride, int64_t vectors,
                                                    int64_t head_dim, const float* const* v_tile, int64_t n,
                                                    float* acc) {
  constexpr int64_t kVectorsPerPass = 6;
  for (int64_t offset = 0; offset < head_dim; offset += 64) {
    const int64_t chunks = std::min<int64_t>(4, (head_dim - offset) / 16);
    for (int64_t g = 0; g < vectors; g += kVectorsPerPass) {
      const float* w = weights + g * stride;
      float* a = acc + g * head_dim;
      switch (std::min(kVectorsPerPass, vectors - g)) {
        case 6: accumulate_chunks<6>(chunks, w, stride, v_tile, n, offset, a, head_dim); break;
        case 5: accumulate_chunks<5>(chunks, w, stride, v_tile, n, offset, a, head_dim); break;
        case 4: accumulate_chunks<4>(chunks, w, stride, v_tile, n, offset, a, head_dim); break;
        case 3: accumulate_chunks<3>(chunks, w, stride, v_tile, n, offset, a, head_dim); break;
        case 2: accumulate_chunks<2>(chunks, w, stride, v_tile, n, offset, a, head_dim); break;
        default: accumulate_chunks<1>(chunks, w, stride, v_tile, n, offset, a, head_dim);
      }
    }
  }
}

// The max of x[0, n), n >= 1.
__attribute__((target("avx512f"))) inline float max_of(const float* x, int64_t n) {
  __m512 top = _mm512_set1_ps(x[0]);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(x + i));
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1);
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, x + i));
  return _mm512_reduce_max_ps(top);
}

// x[i] = exp(x[i] - shift) for i < n (x <= shift), and their sum.
__attribute__((target("avx512f"))) inline float exp_and_sum(float* x, int64_t n, float shift) {
  const __m512 offset = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 lanes = n - i >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = infer_recipes::exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + i), offset));
    _mm512_mask_storeu_ps(x + i, lanes, e);
    sum = _mm512_mask_add_ps(sum, lanes, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace avx512_attention
#endif

// Whether the AVX-512 tile routines can run: built with AVX2 (so with immintrin.h), on a CPU with
// AVX-512, for a head dim of whole 16-float vectors.
inline bool avx512_tiles(int64_t head_dim) {
#if defined(__AVX2__) && defined(__FMA__)
  return head_dim % 16 == 0 && __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

// The max of x[0, n), n >= 1; `wide` as for tile_scores.
inline float max_of(const float* x, int64_t n, bool wide) {
#if defined(__AVX2__) && defined(__FMA__)
  if (wide) return avx512_attention::max_of(x, n);
#endif
  return infer_recipes::max_of(x, n);
}

// x[i] = exp(x[i] - shift) for i < n (x <= shift), and their sum; `wide` as for tile_scores.
inline float exp_and_sum(float* x, int64_t n, float shift, bool wide) {
#if defined(__AVX2__) && defined(__FMA__)
  if (wide) return avx512_attention::exp_and_sum(x, n, shift);
#endif
  for (int64_t i = 0; i < n; ++i) x[i] = infer_recipes::exp_nonpositive(x[i] - shift);
  return infer_recipes::sum_of(x, n);
}

// scores[g * stride + t] = q_g . k_t for the group's query rows and the tile's n key rows; `wide`: by the
// AVX-512 routine (avx512_tiles). The AVX2 path scores keys eight at a time and pads k_tile to a
// multiple of 8 with its last row (those scores are computed and never read).
inline void tile_scores(const float* q_rows, int64_t group, int64_t head_dim, const float** k_tile, int64_t n,
                        float* scores, int64_t stride, bool wide) {
#if defined(__AVX2__) && defined(__FMA__)
  if (wide) return avx512_attention::tile_scores(q_rows, group, head_dim, k_tile, n, scores, stride);
#endif
#ifdef __AVX2__
  if (head_dim % 8 == 0) {
    for (int64_t t = n; t % 8 != 0; ++t) k_tile[t] = k_tile[n - 1];
    for (int64_t t = 0; t < n; t += 8) {
      for (int64_t g = 0; g < group; ++g) {
        scores_of_8_keys(q_rows + g * head_dim, k_tile + t, head_dim, scores + g * stride + t);
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      scores[g * stride + t] = infer_recipes::dot(q_rows + g * head_dim, k_tile[t], head_dim);
    }
  }
}

// acc_g += sum over the tile's n positions of weights[g * stride + t] * v_t, for each query vector g;
// `wide` as for tile_scores.
inline void tile_values(const float* weights, int64_t stride, int64_t group, int64_t head_dim,
                        const float* const* v_tile, int64_t n, float* acc, bool wide) {
#if defined(__AVX2__) && defined(__FMA__)
  if (wide) return avx512_attention::tile_values(weights, stride, group, head_dim, v_tile, n, acc);
#endif
#ifdef __AVX2__
  if (head_dim % 8 == 0) {
    for (int64_t g = 0; g < group; ++g) {
      int64_t d = 0;
      const float* g_weights = weights + g * stride;
      float* g_acc = acc + g * head_dim;
      for (; d + 64 <= head_dim; d += 64) accumulate_rows<8>(g_weights, v_tile, n, d, g_acc + d);
      for (; d < head_dim; d += 8) accumulate_rows<1>(g_weights, v_tile, n, d, g_acc + d);
    }
    return;
  }
#endif
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t g = 0; g < group; ++g) {
      const float weight = weights[g * stride + t];
      float* a = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += weight * v_tile[t][d];
    }
  }
}

// kHeadDim > 0: the head dim known when compiling (64, 128), so the per-key loops unroll; 0: any.
// cache_t: the caches' storage, scalar_t or int8_t (then read with `key_scales` / `value_scales`).
// Every `rows_per_request` consecutive rows are one request's (a verify step's tokens, each its own
// row): they read the first row's block table, each up to its own length, so each K/V row is read
// once for all of them.
template <typename scalar_t, typename cache_t, int64_t kHeadDim>
void decode_attention(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                      const infer_recipes::CacheScales& key_scales, const infer_recipes::CacheScales& value_scales,
                      const torch::Tensor& block_table, const torch::Tensor& seq_lens, const float* sinks, double scale,
                      int64_t sliding_window, int64_t rows_per_request, torch::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = block_table.size(1);
  const int64_t vectors = rows_per_request * group;  // query vectors per item, row-major over (row, head)
  const int64_t row_bytes = head_dim * static_cast<int64_t>(sizeof(cache_t));
  const scalar_t* q = query.data_ptr<scalar_t>();
  const cache_t* keys = key_cache.data_ptr<cache_t>();
  const cache_t* values = value_cache.data_ptr<cache_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  scalar_t* o = out.data_ptr<scalar_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool wide = avx512_tiles(head_dim);
  // An item is one (request, KV head); its row b attends to positions [first_position(b), lens[b]).
  const auto first_position = [&](int64_t b) {
    return sliding_window > 0 ? std::max<int64_t>(0, lens[b] - sliding_window) : int64_t{0};
  };
  const auto first_row = [&](int64_t item) { return item / num_kv_heads * rows_per_request; };
  // The positions an item's rows attend to between them.
  const auto item_begin = [&](int64_t item) {
    int64_t begin = first_position(first_row(item));
    for (int64_t r = 1; r < rows_per_request; ++r) begin = std::min(begin, first_position(first_row(item) + r));
    return begin;
  };
  const auto item_end = [&](int64_t item) {
    return *std::max_element(lens + first_row(item), lens + first_row(item) + rows_per_request);
  };
  // rows[t] = the cache row (slot * Hkv + KV head) of an item's position start + t, t < n: one division
  // for the run, the block table read once per block.
  const auto fill_rows = [&](int64_t item, int64_t start, int64_t n, int64_t* rows) {
    const int32_t* item_table = table + first_row(item) * table_width;
    const int64_t kv_head = item % num_kv_heads;
    int64_t block = start / block_size, in_block = start % block_size;
    for (int64_t t = 0; t < n; ++t) {
      rows[t] = (static_cast<int64_t>(item_table[block]) * block_size + in_block) * num_kv_heads + kv_head;
      if (++in_block == block_size) {
        in_block = 0;
        ++block;
      }
    }
  };
  const auto prefetch_rows = [&](const cache_t* cache, const int64_t* rows, int64_t n) {
    for (int64_t t = 0; t < n; ++t) prefetch_row(cache + rows[t] * head_dim, row_bytes);
  };

  at::parallel_for(0, batch / rows_per_request * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_rows(vectors * head_dim), acc(vectors * head_dim), scores(vectors * kChunk);
    std::vector<float> rows_as_float(kTile * head_dim);
    std::vector<int64_t> rows(kChunk), next_rows(kTile);
    std::vector<float> running_max(vectors), denominator(vectors);
    const float* tile[kTile];
    // tile[t] = cache row rows[t] as fp32 (in place, or converted into rows_as_float), t < m.
    const auto read_tile = [&](const cache_t* cache, const infer_recipes::CacheScales& scales, const int64_t* rows,
                               int64_t m) {
      for (int64_t t = 0; t < m; ++t) {
        tile[t] = infer_recipes::cached_row(cache, rows[t], head_dim, scales, rows_as_float.data() + t * head_dim);
      }
    };
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kv_head = item % num_kv_heads;
      const int64_t length = item_end(item);
      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t b = first_row(item) + v / group, head = kv_head * group + v % group;
        const scalar_t* q_row = q + (b * num_heads + head) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q_rows[v * head_dim + d] = static_cast<float>(q_row[d]) * static_cast<float>(scale);
        // A sink is one more logit in the denominator whose value row is zero.
        running_max[v] = sinks ? sinks[head] : neg_inf;
        denominator[v] = sinks ? 1.0f : 0.0f;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t chunk_start = item_begin(item); chunk_start < length; chunk_start += kChunk) {
        const int64_t n = std::min(kChunk, length - chunk_start);
        fill_rows(item, chunk_start, n, rows.data());
        // The chunk's scores, a tile of keys at a time, the next tile's keys (and then the chunk's first
        // values) prefetched meanwhile.
        for (int64_t t0 = 0; t0 < n; t0 += kTile) {
          const int64_t m = std::min(kTile, n - t0);
          read_tile(keys, key_scales, rows.data() + t0, m);
          if (t0 + kTile < n) {
            prefetch_rows(keys, rows.data() + t0 + kTile, std::min(kTile, n - t0 - kTile));
          } else {
            prefetch_rows(values, rows.data(), std::min(kTile, n));
          }
          tile_scores(q_rows.data(), vectors, head_dim, tile, m, scores.data() + t0, kChunk, wide);
        }
        for (int64_t v = 0; v < vectors; ++v) {
          float* s = scores.data() + v * kChunk;
          // The chunk's positions this vector's row attends to: [lo, hi); the others weigh nothing.
          const int64_t b = first_row(item) + v / group;
          const int64_t lo = std::max<int64_t>(0, first_position(b) - chunk_start);
          const int64_t hi = std::min(n, lens[b] - chunk_start);
          if (lo >= hi) {
            std::fill(s, s + n, 0.0f);
            continue;
          }
          const float new_max = std::max(running_max[v], max_of(s + lo, hi - lo, wide));
          const float correction = std::exp(running_max[v] - new_max);  // 0 while nothing is accumulated
          const float weight_sum = exp_and_sum(s + lo, hi - lo, new_max, wide);
          std::fill(s, s + lo, 0.0f);
          std::fill(s + hi, s + n, 0.0f);
          denominator[v] = denominator[v] * correction + weight_sum;
          running_max[v] = new_max;
          if (correction != 1.0f) {
            float* a = acc.data() + v * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          }
        }
        // The value sums, the next tile's values (and then the next chunk's or item's first keys) prefetched.
        const bool last_chunk = chunk_start + kChunk >= length;
        for (int64_t t0 = 0; t0 < n; t0 += kTile) {
          const int64_t m = std::min(kTile, n - t0);
          read_tile(values, value_scales, rows.data() + t0, m);
          if (t0 + kTile < n) {
            prefetch_rows(values, rows.data() + t0 + kTile, std::min(kTile, n - t0 - kTile));
          } else if (!last_chunk) {
            const int64_t next_n = std::min(kTile, length - chunk_start - kChunk);
            fill_rows(item, chunk_start + kChunk, next_n, next_rows.data());
            prefetch_rows(keys, next_rows.data(), next_n);
          } else if (item + 1 < end) {
            const int64_t next_start = item_begin(item + 1);
            const int64_t next_n = std::min(kTile, item_end(item + 1) - next_start);
            fill_rows(item + 1, next_start, next_n, next_rows.data());
            prefetch_rows(keys, next_rows.data(), next_n);
          }
          tile_values(scores.data() + t0, kChunk, vectors, head_dim, tile, m, acc.data(), wide);
        }
      }
      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t b = first_row(item) + v / group, head = kv_head * group + v % group;
        scalar_t* row = o + (b * num_heads + head) * head_dim;
        const float inverse = 1.0f / denominator[v];
        for (int64_t d = 0; d < head_dim; ++d) row[d] = static_cast<scalar_t>(acc[v * head_dim + d] * inverse);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                                     torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                                     int64_t sliding_window, c10::optional<torch::Tensor> sinks,
                                     c10::optional<torch::Tensor> key_scale, c10::optional<torch::Tensor> value_scale,
                                     c10::optional<torch::Tensor> rows_per_request_tensor, bool allow_amx) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, H, D] and caches [N, block, Hkv, D] expected");
  // Read here rather than by the caller: a host read per layer in Python cost 6 us.
  int64_t rows_per_request = 1;
  if (rows_per_request_tensor.has_value()) {
    TORCH_CHECK(rows_per_request_tensor->scalar_type() == torch::kInt64 && rows_per_request_tensor->numel() == 1 &&
                    rows_per_request_tensor->is_cpu(),
                "rows_per_request must be one int64 on the CPU");
    rows_per_request = *rows_per_request_tensor->data_ptr<int64_t>();
  }
  TORCH_CHECK(rows_per_request >= 1 && query.size(0) % rows_per_request == 0,
              "rows_per_request must divide the query rows");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "KV caches must be contiguous");
  TORCH_CHECK(key_cache.scalar_type() == value_cache.scalar_type() &&
                  (key_cache.scalar_type() == torch::kChar || key_cache.scalar_type() == query.scalar_type()),
              "KV caches must be int8 or the query's dtype");
  const infer_recipes::CacheScales key_scales = infer_recipes::cache_scales(key_cache, key_scale);
  const infer_recipes::CacheScales value_scales = infer_recipes::cache_scales(value_cache, value_scale);
  const bool quantized = key_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64,
              "block_table int32 and seq_lens int64 expected");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must group over KV heads");
  query = query.contiguous();
  block_table = block_table.contiguous();
  seq_lens = seq_lens.contiguous();
  torch::Tensor sink_logits;
  if (sinks.has_value()) sink_logits = sinks->to(torch::kFloat32).contiguous();
  auto out = torch::empty_like(query);
  if (allow_amx && query.scalar_type() == torch::kBFloat16 && !quantized &&
      amx_decode_attention_fits(query.size(2), key_cache.size(1))) {
    const float* sink_data = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
    infer_recipes::amx_decode_attention({query.data_ptr<at::BFloat16>(), key_cache.data_ptr<at::BFloat16>(),
                                         value_cache.data_ptr<at::BFloat16>(), block_table.data_ptr<int32_t>(),
                                         seq_lens.data_ptr<int64_t>(), sink_data, out.data_ptr<at::BFloat16>(),
                                         query.size(0), query.size(1), key_cache.size(2), query.size(2),
                                         key_cache.size(1), block_table.size(1), static_cast<float>(scale),
                                         sliding_window, rows_per_request});
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    const float* sink_data = sinks.has_value() ? sink_logits.data_ptr<float>() : nullptr;
    const auto run = [&](auto head_dim) {
      constexpr int64_t kHeadDim = decltype(head_dim)::value;
      if (quantized) {
        decode_attention<scalar_t, int8_t, kHeadDim>(query, key_cache, value_cache, key_scales, value_scales,
                                                     block_table, seq_lens, sink_data, scale, sliding_window,
                                                     rows_per_request, out);
      } else {
        decode_attention<scalar_t, scalar_t, kHeadDim>(query, key_cache, value_cache, key_scales, value_scales,
                                                       block_table, seq_lens, sink_data, scale, sliding_window,
                                                     rows_per_request, out);
      }
    };
    switch (query.size(2)) {
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor seq_lens, float scale, int sliding_window, Tensor? sinks=None, Tensor? key_scale=None, "
        "Tensor? value_scale=None, Tensor? rows_per_request=None, bool allow_amx=True) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
