// Writes a step's new K/V (or MLA latent) rows into the paged caches at their slots: one memcpy per
// token and cache, where index_copy_ pays a dispatch and an iterator setup per cache, which is most
// of its time at a decode step's few rows. A slot outside the cache is an error, never a write.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
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
  TORCH_CHECK(rows.scalar_type() == cache.scalar_type(), "rows of ", rows.scalar_type(), " for a cache of ",
              cache.scalar_type());
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
  const int64_t row_bytes = caches[0].numel() / std::max<int64_t>(num_slots, 1) * caches[0].element_size();
  at::parallel_for(0, tokens, kTokensPerTask, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < sources.size(); ++i) {
      const char* source = static_cast<const char*>(sources[i].data_ptr());
      const int64_t token_bytes = sources[i].stride(0) * sources[i].element_size();
      char* cache = static_cast<char*>(caches[i].data_ptr());
      for (int64_t t = begin; t < end; ++t) {
        std::memcpy(cache + slots[t] * row_bytes, source + t * token_bytes, row_bytes);
      }
    }
  });
}

}  // namespace

// key/value [T, Hkv, D] into key_cache/value_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T].
void write_kv_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
                    torch::Tensor slot_mapping) {
  write_rows({key, value}, {key_cache, value_cache}, slot_mapping);
}

// latent [T, L] into latent_cache [num_blocks, block_size, L] at slot_mapping [T].
void write_latent_cache(torch::Tensor latent, torch::Tensor latent_cache, torch::Tensor slot_mapping) {
  write_rows({latent}, {latent_cache}, slot_mapping);
}
