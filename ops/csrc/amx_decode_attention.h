// The decode attention's AMX form for a bf16 cache (amx_decode_attention.cpp), which
// paged_decode_attention.cpp takes where it fits.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace infer_recipes {

// One decode (or verify) call's operands, raw: query [batch, heads, head_dim], caches [blocks,
// block_size, kv_heads, head_dim], block_table [batch, table_width], seq_lens [batch], out as query.
struct PagedDecodeCall {
  const at::BFloat16* query;
  const at::BFloat16* key_cache;
  const at::BFloat16* value_cache;
  const int32_t* block_table;
  const int64_t* seq_lens;
  const float* sinks;  // one logit per query head, or nullptr
  at::BFloat16* out;
  int64_t batch, num_heads, num_kv_heads, head_dim, block_size, table_width;
  float scale;
  int64_t sliding_window;    // 0: none
  int64_t rows_per_request;  // consecutive rows sharing the first one's block table
};

// paged_decode_attention over a bf16 cache with the scores and the value sums as tile products.
void amx_decode_attention(const PagedDecodeCall& call);

}  // namespace infer_recipes

// Whether the AMX form serves this head dim and block size on this CPU (AMX bf16 and AVX-512 BF16,
// Linux's permission for the tiles, head dim 64 or 128, blocks of whole 16-position tiles). Outside the
// namespace, as the functions the extension exports are.
bool amx_decode_attention_fits(int64_t head_dim, int64_t block_size);
