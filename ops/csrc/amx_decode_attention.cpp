// The decode attention over a bf16 paged cache on AMX: the scores and the value sums of up to 16 query
// vectors of one (request, KV head) item as tile products, where the vector kernel
// (paged_decode_attention.cpp) spends a dot product per vector and key and an FMA per vector, value
// row and 16 dims. A verify step's 1 + k rows times the group's query heads are 12 vectors for
// SmolLM2 (16 lanes a pass, more in passes of 16).
// The scores come transposed, [position][vector]: the key tile loads straight from the cache (16
// positions of a block are rows at one stride) against the queries' transpose, built once per item,
// so the softmax runs down the columns with one vector per position, each lane its own vector's
// range (window, length) as a mask. The weights then go to bf16, as torch's CPU flash attention
// rounds them before its value product, in [vector][position] tiles (a 16 x 16 transpose of bf16
// pairs per 32 positions), and each 32 positions' value rows are interleaved in pairs, the layout
// the value product's B tile needs. Both products accumulate in fp32; an online softmax carries the
// sums from chunk to chunk of 256 positions. Positions past a request's end may hold anything:
// their weights are masked to zero and their value rows read as zeros.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_decode_attention.h"
#include "amx_tiles.h"
#include "cpu_math_avx512.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>

#define AMX_ATTENTION_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace amx_attention {

using infer_recipes::PagedDecodeCall;

constexpr int64_t kLanes = 16;          // query vectors a pass: a score tile's columns
constexpr int64_t kKeys = 16;           // positions per score tile (rows of one block)
constexpr int64_t kStep = 32;           // positions per value product: the weight tile's depth
constexpr int64_t kChunk = 256;         // positions whose scores are held at once
constexpr int64_t kMaxHeadDim = 128;

// One thread's working set (about 40 KB): the queries' transpose, a chunk's scores and weights, one
// step's interleaved values and the running sums.
struct alignas(64) Buffers {
  uint16_t queries[kMaxHeadDim / 32][16][32];    // B tiles per 32 dims: [dim pair][vector][2]
  float scores[kChunk][kLanes];                  // [position][vector], then the weights
  uint16_t weights[kChunk / kStep][kLanes][kStep];  // A tiles per step: [vector][position]
  uint16_t values[4][16][32];                    // B tiles per 16 dims: [position pair][dim][2]
  float sums[kLanes][kMaxHeadDim];               // the value sums, [vector][dim]
  uint16_t zero_row[kMaxHeadDim];                // the value row of a position past the end
};

// Tiles, all 16 rows of 64 bytes. Scores: 0-1 two 16-position score tiles, 2-3 their keys, 4-7 the
// queries' transpose (one per 32 dims). Values: 0-3 the sums of 64 dims, 4 the weights, 5-6 values.
infer_recipes::TileConfig uniform_config() {
  infer_recipes::TileConfig config;
  for (int tile = 0; tile < 8; ++tile) {
    config.bytes_per_row[tile] = 64;
    config.rows[tile] = 16;
  }
  return config;
}

// r[i] word j -> r[j] word i: a 16 x 16 transpose of 32-bit words (bf16 pairs) in registers.
__attribute__((target("avx512f"))) inline void transpose_words(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: rows 2i, 2i+1 interleaved
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // r[4i + c]'s 128-bit lane L: word 4L + c of rows 4i .. 4i + 3
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // a 4 x 4 transpose of 128-bit lanes over r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i ab_low = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44);
    const __m512i ab_high = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i cd_low = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i cd_high = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    t[c] = _mm512_shuffle_i32x4(ab_low, cd_low, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(ab_low, cd_low, 0xDD);
    t[8 + c] = _mm512_shuffle_i32x4(ab_high, cd_high, 0x88);
    t[12 + c] = _mm512_shuffle_i32x4(ab_high, cd_high, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// One item's query vectors (lanes past `vectors` are zero) and, per lane, the positions it attends to.
struct Lanes {
  const at::BFloat16* rows[kLanes];
  int64_t out_offsets[kLanes];  // where each vector's output row starts in out
  alignas(64) int32_t first[kLanes];
  alignas(64) int32_t end[kLanes];
  alignas(64) float running_max[kLanes];
  alignas(64) float denominator[kLanes];
  int64_t vectors;
};

// The item's lanes for its vectors [first_vector, first_vector + 16).
Lanes lanes_of(const PagedDecodeCall& c, int64_t item, int64_t first_vector) {
  const int64_t group = c.num_heads / c.num_kv_heads, kv_head = item % c.num_kv_heads;
  const int64_t first_row = item / c.num_kv_heads * c.rows_per_request;
  Lanes lanes;
  lanes.vectors = std::min(kLanes, c.rows_per_request * group - first_vector);
  for (int64_t q = 0; q < kLanes; ++q) {
    if (q >= lanes.vectors) {
      lanes.rows[q] = nullptr;
      lanes.first[q] = lanes.end[q] = 0;  // attends to nothing
      lanes.running_max[q] = -std::numeric_limits<float>::infinity();
      lanes.denominator[q] = 0.0f;
      continue;
    }
    const int64_t v = first_vector + q, b = first_row + v / group, head = kv_head * group + v % group;
    lanes.out_offsets[q] = (b * c.num_heads + head) * c.head_dim;
    lanes.rows[q] = c.query + lanes.out_offsets[q];
    lanes.end[q] = static_cast<int32_t>(c.seq_lens[b]);
    const int64_t first = c.sliding_window > 0 ? std::max<int64_t>(0, c.seq_lens[b] - c.sliding_window) : 0;
    lanes.first[q] = static_cast<int32_t>(first);
    // A sink is one more logit in the denominator whose value row is zero.
    lanes.running_max[q] = c.sinks ? c.sinks[head] : -std::numeric_limits<float>::infinity();
    lanes.denominator[q] = c.sinks ? 1.0f : 0.0f;
  }
  return lanes;
}

// buffers.queries[s][j][q] = query q's dims (32 s + 2 j, 32 s + 2 j + 1).
AMX_ATTENTION_TARGET void transpose_queries(const Lanes& lanes, int64_t head_dim, Buffers& buffers) {
  for (int64_t s = 0; s < head_dim / 32; ++s) {
    __m512i r[16];
    for (int q = 0; q < kLanes; ++q) {
      r[q] = lanes.rows[q] ? _mm512_loadu_si512(lanes.rows[q] + 32 * s) : _mm512_setzero_si512();
    }
    transpose_words(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(buffers.queries[s][j], r[j]);
  }
}

// The cache rows of one item: position p's row, through the first row's block table.
struct ItemRows {
  const at::BFloat16* cache;
  const int32_t* table;
  int64_t block_size, kv_head, num_kv_heads, head_dim;

  const at::BFloat16* row(int64_t p) const {
    const int64_t slot = static_cast<int64_t>(table[p / block_size]) * block_size + p % block_size;
    return cache + (slot * num_kv_heads + kv_head) * head_dim;
  }
  void prefetch(int64_t first, int64_t count, int64_t end) const {
    for (int64_t p = first; p < std::min(first + count, end); ++p) {
      const char* start = reinterpret_cast<const char*>(row(p));
      for (int64_t offset = 0; offset < head_dim * 2; offset += 64) _mm_prefetch(start + offset, _MM_HINT_T0);
    }
  }
};

using infer_recipes::memory_barrier;

// Score tiles 0 and 1 += the key rows at `low` and `high` (dims [32 s, 32 s + 32)) times query tile
// QUERIES: a macro because GCC's tile intrinsics paste their tile numbers into the assembly as written.
#define SCORE_DIMS(low, high, stride, s, QUERIES) \
  _tile_loadd(2, (low) + 32 * (s), stride);       \
  _tile_loadd(3, (high) + 32 * (s), stride);      \
  _tile_dpbf16ps(0, 2, QUERIES);                  \
  _tile_dpbf16ps(1, 3, QUERIES)

// buffers.scores[t][q] = keys[start + t] . query q for t < 16 x tiles: two score tiles at a time, each
// 16 rows of one block loaded at the cache's row stride (a block holds whole 16-position tiles).
template <int64_t kHeadDim>
AMX_ATTENTION_TARGET void chunk_scores(const ItemRows& keys, int64_t start, int64_t tiles, int64_t end,
                                       Buffers& buffers) {
  const int64_t stride = keys.num_kv_heads * kHeadDim * static_cast<int64_t>(sizeof(at::BFloat16));
  memory_barrier();
  _tile_loadd(4, buffers.queries[0], 64);
  _tile_loadd(5, buffers.queries[1], 64);
  if constexpr (kHeadDim == 128) {
    _tile_loadd(6, buffers.queries[2], 64);
    _tile_loadd(7, buffers.queries[3], 64);
  }
  for (int64_t u = 0; u < tiles; u += 2) {
    keys.prefetch(start + (u + 2) * kKeys, 2 * kKeys, end);
    const at::BFloat16* low = keys.row(start + u * kKeys);
    // An odd last tile computes its neighbour's scores again (never read).
    const at::BFloat16* high = u + 1 < tiles ? keys.row(start + (u + 1) * kKeys) : low;
    _tile_zero(0);
    _tile_zero(1);
    SCORE_DIMS(low, high, stride, 0, 4);
    SCORE_DIMS(low, high, stride, 1, 5);
    if constexpr (kHeadDim == 128) {
      SCORE_DIMS(low, high, stride, 2, 6);
      SCORE_DIMS(low, high, stride, 3, 7);
    }
    _tile_stored(0, buffers.scores[u * kKeys], kLanes * sizeof(float));
    _tile_stored(1, buffers.scores[std::min(u + 1, tiles - 1) * kKeys], kLanes * sizeof(float));
  }
  memory_barrier();
}
#undef SCORE_DIMS

// The lanes attending to position p: first <= p < end.
AMX_ATTENTION_TARGET inline __mmask16 attending(const Lanes& lanes, int64_t p) {
  const __m512i position = _mm512_set1_epi32(static_cast<int32_t>(p));
  return _mm512_cmp_epi32_mask(position, _mm512_load_si512(lanes.first), _MM_CMPINT_NLT) &
         _mm512_cmp_epi32_mask(position, _mm512_load_si512(lanes.end), _MM_CMPINT_LT);
}

// The chunk's scores (positions start + t, t < n) become softmax weights against the running max, zero
// where a lane does not attend; the lanes' denominators and value sums are rescaled to the new max.
AMX_ATTENTION_TARGET void chunk_softmax(Lanes& lanes, int64_t start, int64_t n, float scale, int64_t head_dim,
                                        Buffers& buffers) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 chunk_max = neg_inf;
  for (int64_t t = 0; t < n; ++t) {
    const __m512 s = _mm512_mul_ps(_mm512_load_ps(buffers.scores[t]), _mm512_set1_ps(scale));
    _mm512_store_ps(buffers.scores[t], s);
    chunk_max = _mm512_mask_max_ps(chunk_max, attending(lanes, start + t), chunk_max, s);
  }
  const __m512 running_max = _mm512_load_ps(lanes.running_max);
  const __m512 new_max = _mm512_max_ps(running_max, chunk_max);
  // A lane with nothing yet (no sink, no position so far) shifts by 0 and rescales nothing.
  const __mmask16 started = _mm512_cmp_ps_mask(running_max, neg_inf, _CMP_NEQ_OQ);
  const __mmask16 attended = _mm512_cmp_ps_mask(new_max, neg_inf, _CMP_NEQ_OQ);
  const __m512 shift = _mm512_mask_mov_ps(_mm512_setzero_ps(), attended, new_max);
  const __m512 correction = _mm512_maskz_mov_ps(
      started, infer_recipes::exp_nonpositive16(_mm512_maskz_sub_ps(started, running_max, new_max)));
  __m512 weight_sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const __m512 e = infer_recipes::exp_nonpositive16(_mm512_sub_ps(_mm512_load_ps(buffers.scores[t]), shift));
    const __m512 w = _mm512_maskz_mov_ps(attending(lanes, start + t), e);
    _mm512_store_ps(buffers.scores[t], w);
    weight_sum = _mm512_add_ps(weight_sum, w);
  }
  _mm512_store_ps(lanes.denominator, _mm512_fmadd_ps(_mm512_load_ps(lanes.denominator), correction, weight_sum));
  _mm512_store_ps(lanes.running_max, new_max);
  alignas(64) float corrections[kLanes];
  _mm512_store_ps(corrections, correction);
  for (int64_t q = 0; q < lanes.vectors; ++q) {
    if (corrections[q] == 1.0f) continue;
    const __m512 factor = _mm512_set1_ps(corrections[q]);
    for (int64_t d = 0; d < head_dim; d += 16) {
      _mm512_store_ps(buffers.sums[q] + d, _mm512_mul_ps(_mm512_load_ps(buffers.sums[q] + d), factor));
    }
  }
}

// buffers.weights[step][q][i] = the weight of position 32 step + i for lane q, in bf16 (rounded to
// nearest even, as torch rounds), zero past n: each pair of score rows interleaved into bf16 pairs,
// then transposed.
AMX_ATTENTION_TARGET void chunk_weight_tiles(int64_t n, Buffers& buffers) {
  // Even positions' weights in the low half of each pair, odd ones' in the high half.
  alignas(64) static constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t step = 0; step * kStep < n; ++step) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j) {
      const int64_t t = step * kStep + 2 * j;
      const __m512 even = t < n ? _mm512_load_ps(buffers.scores[t]) : _mm512_setzero_ps();
      const __m512 odd = t + 1 < n ? _mm512_load_ps(buffers.scores[t + 1]) : _mm512_setzero_ps();
      r[j] = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
    }
    transpose_words(r);
    for (int q = 0; q < kLanes; ++q) _mm512_store_si512(buffers.weights[step][q], r[q]);
  }
}

// buffers.values[c][j] = value rows (start + 2 j, start + 2 j + 1), dims [offset + 16 c, + 16),
// interleaved: the B tiles of one step's value product over 64 dims; rows at or past end are zeros.
AMX_ATTENTION_TARGET void step_value_tiles(const ItemRows& values, int64_t start, int64_t end, int64_t offset,
                                           Buffers& buffers) {
  alignas(64) static constexpr int16_t kLow[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                   8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr int16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                    24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int64_t j = 0; j < 16; ++j) {
    const int64_t p = start + 2 * j;
    const auto* zeros = reinterpret_cast<const at::BFloat16*>(buffers.zero_row);
    const at::BFloat16* even = (p < end ? values.row(p) : zeros) + offset;
    const at::BFloat16* odd = (p + 1 < end ? values.row(p + 1) : zeros) + offset;
    for (int64_t half = 0; half < 2; ++half) {
      const __m512i a = _mm512_loadu_si512(even + 32 * half), b = _mm512_loadu_si512(odd + 32 * half);
      _mm512_store_si512(buffers.values[2 * half][j], _mm512_permutex2var_epi16(a, low, b));
      _mm512_store_si512(buffers.values[2 * half + 1][j], _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// buffers.sums += weights x values for the chunk's positions [start, start + n), 64 dims a pass over them.
template <int64_t kHeadDim>
AMX_ATTENTION_TARGET void chunk_value_sums(const ItemRows& values, int64_t start, int64_t n, int64_t end,
                                           Buffers& buffers) {
  constexpr int64_t kSumStride = kMaxHeadDim * sizeof(float);
  for (int64_t offset = 0; offset < kHeadDim; offset += 64) {
    memory_barrier();
    _tile_loadd(0, buffers.sums[0] + offset, kSumStride);
    _tile_loadd(1, buffers.sums[0] + offset + 16, kSumStride);
    _tile_loadd(2, buffers.sums[0] + offset + 32, kSumStride);
    _tile_loadd(3, buffers.sums[0] + offset + 48, kSumStride);
    for (int64_t step = 0; step * kStep < n; ++step) {
      values.prefetch(start + (step + 1) * kStep, kStep, end);
      step_value_tiles(values, start + step * kStep, end, offset, buffers);
      memory_barrier();
      _tile_loadd(4, buffers.weights[step], 64);
      _tile_loadd(5, buffers.values[0], 64);
      _tile_loadd(6, buffers.values[1], 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(5, buffers.values[2], 64);
      _tile_loadd(6, buffers.values[3], 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 6);
      memory_barrier();
    }
    _tile_stored(0, buffers.sums[0] + offset, kSumStride);
    _tile_stored(1, buffers.sums[0] + offset + 16, kSumStride);
    _tile_stored(2, buffers.sums[0] + offset + 32, kSumStride);
    _tile_stored(3, buffers.sums[0] + offset + 48, kSumStride);
    memory_barrier();
  }
}

// Each lane's output row: its value sums over its denominator, in bf16.
AMX_ATTENTION_TARGET void write_outputs(const Lanes& lanes, int64_t head_dim, const Buffers& buffers,
                                        at::BFloat16* out) {
  for (int64_t q = 0; q < lanes.vectors; ++q) {
    const __m512 inverse = _mm512_set1_ps(1.0f / lanes.denominator[q]);
    for (int64_t d = 0; d < head_dim; d += 16) {
      const __m256bh row = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(buffers.sums[q] + d), inverse));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + lanes.out_offsets[q] + d), (__m256i)row);
    }
  }
}

// Items [begin, end) on this thread, 16 of an item's query vectors a pass.
template <int64_t kHeadDim>
AMX_ATTENTION_TARGET void attend_items(const PagedDecodeCall& c, int64_t begin, int64_t end) {
  Buffers buffers;
  std::memset(buffers.zero_row, 0, sizeof buffers.zero_row);
  const infer_recipes::TileConfig config = uniform_config();
  _tile_loadconfig(&config);
  const int64_t vectors = c.rows_per_request * (c.num_heads / c.num_kv_heads);
  for (int64_t item = begin; item < end; ++item) {
    const int32_t* table = c.block_table + item / c.num_kv_heads * c.rows_per_request * c.table_width;
    const int64_t kv_head = item % c.num_kv_heads;
    const ItemRows keys{c.key_cache, table, c.block_size, kv_head, c.num_kv_heads, kHeadDim};
    const ItemRows values{c.value_cache, table, c.block_size, kv_head, c.num_kv_heads, kHeadDim};
    for (int64_t first_vector = 0; first_vector < vectors; first_vector += kLanes) {
      Lanes lanes = lanes_of(c, item, first_vector);
      // Steps and chunks on a grid of absolute positions, so that a vector's sums do not depend on the
      // other vectors of its pass (a verify step's rows read together or one by one: the same result).
      const int64_t first = *std::min_element(lanes.first, lanes.first + lanes.vectors) / kStep * kStep;
      const int64_t last = *std::max_element(lanes.end, lanes.end + lanes.vectors);
      transpose_queries(lanes, kHeadDim, buffers);
      std::memset(buffers.sums, 0, sizeof buffers.sums);
      for (int64_t start = first; start < last; start = (start / kChunk + 1) * kChunk) {
        const int64_t n = std::min((start / kChunk + 1) * kChunk, last) - start;
        chunk_scores<kHeadDim>(keys, start, (n + kKeys - 1) / kKeys, last, buffers);
        values.prefetch(start, kStep, last);
        chunk_softmax(lanes, start, n, c.scale, kHeadDim, buffers);
        chunk_weight_tiles(n, buffers);
        chunk_value_sums<kHeadDim>(values, start, n, last, buffers);
      }
      write_outputs(lanes, kHeadDim, buffers, c.out);
    }
  }
  _tile_release();
}

}  // namespace amx_attention

bool amx_decode_attention_fits(int64_t head_dim, int64_t block_size) {
  return (head_dim == 64 || head_dim == 128) && block_size % amx_attention::kKeys == 0 &&
         __builtin_cpu_supports("amx-bf16") && __builtin_cpu_supports("avx512bf16") && amx_available();
}

namespace infer_recipes {

void amx_decode_attention(const PagedDecodeCall& call) {
  TORCH_CHECK(amx_decode_attention_fits(call.head_dim, call.block_size), "the AMX decode attention does not fit");
  const int64_t items = call.batch / call.rows_per_request * call.num_kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    if (call.head_dim == 64) {
      amx_attention::attend_items<64>(call, begin, end);
    } else {
      amx_attention::attend_items<128>(call, begin, end);
    }
  });
}

}  // namespace infer_recipes

#else  // not x86-64 Linux: no tiles

bool amx_decode_attention_fits(int64_t, int64_t) { return false; }

namespace infer_recipes {

void amx_decode_attention(const PagedDecodeCall&) { TORCH_CHECK(false, "the AMX decode attention needs x86-64 Linux"); }

}  // namespace infer_recipes

#endif

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("amx_decode_attention_fits(int head_dim, int block_size) -> bool", &amx_decode_attention_fits);
}
