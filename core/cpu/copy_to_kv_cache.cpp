// cpu/copy_to_kv_cache.cpp - CPU reference of the K/V-cache write: sequence by sequence, token by
// token, one memcpy per K row and per V row, once every length and cache row has been checked.
#include "copy_to_kv_cache.h"

#include <cstring>

namespace nvte::cpu {

using kv_cache::Format;

void copy_to_kv_cache(const kv_cache::CopyParams &p, const Tensor &new_k, const Tensor &new_v, Tensor &k_cache,
                      Tensor &v_cache, const Tensor *page_table, const Tensor &cu_new_lens,
                      const Tensor &cu_cached_lens) {
  const auto ptr = [](const Tensor &t) { return t.params[kNVTERowwiseData].data_ptr; };
  const int32_t *cn = static_cast<const int32_t *>(ptr(cu_new_lens));
  const int32_t *cc = static_cast<const int32_t *>(ptr(cu_cached_lens));
  const int32_t *table = page_table ? static_cast<const int32_t *>(ptr(*page_table)) : nullptr;
  const char *nk = static_cast<const char *>(ptr(new_k)), *nv = static_cast<const char *>(ptr(new_v));
  char *kc = static_cast<char *>(ptr(k_cache)), *vc = static_cast<char *>(ptr(v_cache));
  NVTE_CHECK(cn[0] >= 0 && cc[0] >= 0, "cu_new_lens[0] (", cn[0], ") and cu_cached_lens[0] (", cc[0],
             ") must be >= 0");
  for (int64_t i = 0; i < p.b; ++i) {
    const int64_t n = (int64_t)cn[i + 1] - cn[i], c = (int64_t)cc[i + 1] - cc[i];
    NVTE_CHECK(n >= 0 && c >= n, "sequence ", i, ": ", n, " new tokens and ", c,
               " cached after the step; the lengths must be non-decreasing with cached >= new");
    NVTE_CHECK(c <= p.capacity, "sequence ", i, " would hold ", c, " tokens; the cache holds ", p.capacity);
    if (p.format == Format::THD)
      NVTE_CHECK(cn[i + 1] <= p.rows_in, "sequence ", i, "'s new tokens end at row ", cn[i + 1], "; new_k has ",
                 p.rows_in, " rows");
    else
      NVTE_CHECK(n <= p.max_ctx_len, "sequence ", i, " brings ", n, " new tokens; max_ctx_len is ", p.max_ctx_len);
    for (int64_t j = 0; j < n; ++j)
      NVTE_CHECK(kv_cache::cache_row(p, table, i, c - n + j) >= 0, "sequence ", i, " position ", c - n + j,
                 ": its page id is outside [0, ", p.pages, ")");
  }
  // Checked first, written after: a rejected call leaves the caches as they were.
  for (int64_t i = 0; i < p.b; ++i) {
    const int64_t n = (int64_t)cn[i + 1] - cn[i], c = (int64_t)cc[i + 1] - cc[i];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t row = kv_cache::cache_row(p, table, i, c - n + j);
      int64_t src;
      if (p.format == Format::THD) src = cn[i] + j;
      else src = p.format == Format::BSHD ? i * p.max_ctx_len + j : j * p.b + i;
      std::memcpy(kc + row * p.k_row_bytes, nk + src * p.k_row_bytes, (size_t)p.k_row_bytes);
      std::memcpy(vc + row * p.v_row_bytes, nv + src * p.v_row_bytes, (size_t)p.v_row_bytes);
    }
  }
}

}  // namespace nvte::cpu
