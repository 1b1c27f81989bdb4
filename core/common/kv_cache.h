// kv_cache.h - the validated geometry of one nvte_copy_to_kv_cache call (fused_attn.h) and the
// rule that maps a new token to its cache row, shared by the CPU reference and the CUDA kernel so
// both place every token the same way.
#pragma once

#include <cstdint>

#include "numeric.h"  // NVTE_HD

namespace nvte::kv_cache {

enum class Format { BSHD, SBHD, THD };

struct CopyParams {
  Format format = Format::BSHD;
  bool paged = true;
  bool has_table = false;      // non-paged: slots from the table's first column (else slot i)
  int64_t b = 0;
  int64_t rows_in = 0;         // rows of new_k / new_v: b * max_ctx_len (BSHD/SBHD) or t (THD)
  int64_t max_ctx_len = 0;
  int64_t pages = 0;           // paged: num_pages; non-paged: slots
  int64_t page_size = 0;       // paged: tokens per page; non-paged: max_seq_len (rows per slot)
  int64_t pages_per_seq = 0;   // the page table's row length
  int64_t capacity = 0;        // positions a sequence may use
  int64_t k_row_bytes = 0, v_row_bytes = 0;  // h * d_k and h * d_v elements, in bytes
};

// BSHD/SBHD row r of new_k: (sequence, token within it). THD finds the sequence from cu_new_lens.
NVTE_HD void dense_token(const CopyParams &p, int64_t r, int64_t &seq, int64_t &j) {
  if (p.format == Format::BSHD) {
    seq = r / p.max_ctx_len;
    j = r % p.max_ctx_len;
  } else {
    seq = r % p.b;
    j = r / p.b;
  }
}

// Cache row (page * page_size + slot) of position pos of sequence seq, or -1 when it falls outside
// the cache (a position past the capacity or a page id out of range). table: int32 rows of
// pages_per_seq entries (may be null for a non-paged cache without one).
NVTE_HD int64_t cache_row(const CopyParams &p, const int32_t *table, int64_t seq, int64_t pos) {
  if (pos < 0 || pos >= p.capacity) return -1;
  int64_t page;
  if (p.paged) page = table[seq * p.pages_per_seq + pos / p.page_size];
  else page = p.has_table ? table[seq * p.pages_per_seq] : seq;
  if (page < 0 || page >= p.pages) return -1;
  return page * p.page_size + (p.paged ? pos % p.page_size : pos);
}

}  // namespace nvte::kv_cache
