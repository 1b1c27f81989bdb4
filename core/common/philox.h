// philox.h - the Philox-4x32-10 counter-based generator (Salmon et al., SC'11), host and device.
//
// A counter-based generator turns (key, counter) into random words with no state, so the
// attention forward and backward can regenerate the same dropout decision for element
// (b, h, i, j) independently, on any thread, in any order.
#pragma once

#include <cstdint>

#include "numeric.h"  // NVTE_HD

namespace nvte {

struct Philox4x32 {
  uint32_t v[4];
};

// 32 x 32 -> 64-bit product split into its high and low words.
NVTE_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t *hi, uint32_t *lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Ten rounds of the Philox S-box on the counter, bumping the key by the Weyl constants
// between rounds.
NVTE_HD Philox4x32 philox4x32_10(Philox4x32 ctr, uint32_t key0, uint32_t key1) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(kMul0, ctr.v[0], &hi0, &lo0);
    philox_mulhilo(kMul1, ctr.v[2], &hi1, &lo1);
    ctr = Philox4x32{{hi1 ^ ctr.v[1] ^ key0, lo1, hi0 ^ ctr.v[3] ^ key1, lo0}};
    key0 += kWeyl0;
    key1 += kWeyl1;
  }
  return ctr;
}

}  // namespace nvte
