// cuda/copy_to_kv_cache.h - CUDA backend of nvte_copy_to_kv_cache, the same placement as
// cpu/copy_to_kv_cache.h on `stream`.
#pragma once

#include "../common/kv_cache.h"
#include "../common/tensor.h"

namespace nvte::cuda {

// Rows whose target lies outside the cache (a position past the capacity, a page id out of
// range, more new tokens than max_ctx_len or than THD rows) are skipped: the device-side lengths
// cannot be checked from the host.
void copy_to_kv_cache(const kv_cache::CopyParams &p, const Tensor &new_k, const Tensor &new_v, Tensor &k_cache,
                      Tensor &v_cache, const Tensor *page_table, const Tensor &cu_new_lens,
                      const Tensor &cu_cached_lens, cudaStream_t stream);

}  // namespace nvte::cuda
