// cpu/copy_to_kv_cache.h - CPU reference of nvte_copy_to_kv_cache (fused_attn.h).
#pragma once

#include "../common/kv_cache.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// Copies each new token's K and V rows to its cache row (kv_cache::cache_row). Validated by the
// api layer except the device-side values (lengths, page ids), which are checked here: a length
// or position the cache cannot hold fails with the sequence it belongs to.
void copy_to_kv_cache(const kv_cache::CopyParams &p, const Tensor &new_k, const Tensor &new_v, Tensor &k_cache,
                      Tensor &v_cache, const Tensor *page_table, const Tensor &cu_new_lens,
                      const Tensor &cu_cached_lens);

}  // namespace nvte::cpu
