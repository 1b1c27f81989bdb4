// test_attn_mask_ranges.cpp - rows_with_keys / keys_with_rows (core/common/attn_mask.h) against
// the brute-force union of visible_keys over every row, for every mask rule, window and length
// pair up to 12 x 12. The CUDA attention backend zeroes the rows outside these ranges after
// cuDNN runs, so a range that is too wide leaves garbage and one too narrow erases results.
#include <cstdio>

#include "../../core/common/attn_mask.h"
#include "check.h"

using nvte::attn::KeyRange;
using nvte::attn::MaskRule;

int main() {
  int cases = 0;
  for (int causal = 0; causal < 2; ++causal)
    for (int br = 0; br < 2; ++br)
      for (int64_t wl = -1; wl < 5; ++wl)
        for (int64_t wr = -1; wr < 5; ++wr)
          for (int64_t lq = 0; lq <= 12; ++lq)
            for (int64_t lkv = 0; lkv <= 12; ++lkv) {
              const MaskRule m{causal != 0, br != 0, wl, wr};
              int64_t rlo = -1, rhi = -2, klo = -1, khi = -2;  // brute force; -1 / -2: none
              bool seen[13] = {};
              for (int64_t i = 0; i < lq; ++i) {
                const KeyRange k = nvte::attn::visible_keys(m, i, lq, lkv);
                if (k.lo > k.hi) continue;
                if (rlo < 0) rlo = i;
                rhi = i;
                for (int64_t j = k.lo; j <= k.hi; ++j) seen[j] = true;
              }
              for (int64_t j = 0; j < lkv; ++j)
                if (seen[j]) {
                  if (klo < 0) klo = j;
                  khi = j;
                }
              // The claim under test: rows and keys in between are all in use (one range each).
              for (int64_t j = klo < 0 ? 0 : klo; j <= khi; ++j) EXPECT(seen[j]);
              for (int64_t i = rlo < 0 ? 0 : rlo; i <= rhi; ++i) {
                const KeyRange k = nvte::attn::visible_keys(m, i, lq, lkv);
                EXPECT(k.lo <= k.hi);
              }
              const KeyRange r = nvte::attn::rows_with_keys(m, lq, lkv);
              const KeyRange k = nvte::attn::keys_with_rows(m, lq, lkv);
              const bool r_empty = r.lo > r.hi, k_empty = k.lo > k.hi;
              EXPECT_EQ(r_empty, rlo < 0);
              EXPECT_EQ(k_empty, klo < 0);
              if (!r_empty && rlo >= 0) {
                EXPECT_EQ(r.lo, rlo);
                EXPECT_EQ(r.hi, rhi);
              }
              if (!k_empty && klo >= 0) {
                EXPECT_EQ(k.lo, klo);
                EXPECT_EQ(k.hi, khi);
              }
              ++cases;
            }
  std::printf("%d cases\n", cases);
  return check_report("attn_mask_ranges");
}
