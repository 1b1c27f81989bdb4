// thd_rows.h - which sequence a THD row belongs to, for kernels that give each token row its own
// block and find its sequence themselves (RoPE, the K/V-cache write).
#pragma once

#include <cstdint>

#include "numeric.h"  // NVTE_HD

namespace nvte {

// The sequence i < b with cu[i] <= r < cu[i + 1] (cu: non-decreasing int32 [b + 1]), or -1 when row
// r belongs to none (before cu[0], at or past cu[b]). A binary search over a few cached loads.
NVTE_HD int64_t thd_sequence_of_row(const int32_t *cu, int64_t b, int64_t r) {
  if (b <= 0 || r < cu[0]) return -1;
  int64_t lo = 0, hi = b;  // cu[lo] <= r; the answer is in [lo, hi)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (cu[mid] <= r) lo = mid;
    else hi = mid;
  }
  return r < cu[lo + 1] ? lo : -1;
}

}  // namespace nvte
