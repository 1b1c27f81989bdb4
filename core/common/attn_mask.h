// attn_mask.h - which keys a query sees, ALiBi slopes and the dropout decision of fused
// attention (fused_attn.h), shared by host and device code so every backend masks alike.
//
// Every mask type, window and padding rule of fused_attn.h leaves each query row a contiguous
// band of keys, so a row is described by one inclusive range [lo, hi] (empty when lo > hi).
#pragma once

#include <cmath>
#include <math.h>
#include <cstdint>

#include "numeric.h"  // NVTE_HD
#include "philox.h"

namespace nvte::attn {

// The validated masking rule of one call (see AttnParams).
struct MaskRule {
  bool causal;         // j <= i + diag
  bool bottom_right;   // diag = len_kv - len_q (per sequence) instead of 0
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded
};

struct KeyRange {
  int64_t lo, hi;  // inclusive; empty when lo > hi
};

NVTE_HD int64_t diagonal(const MaskRule &m, int64_t len_q, int64_t len_kv) {
  return m.bottom_right ? len_kv - len_q : 0;
}

// Keys visible to query row i of a sequence with len_q queries and len_kv keys.
NVTE_HD KeyRange visible_keys(const MaskRule &m, int64_t i, int64_t len_q, int64_t len_kv) {
  if (i >= len_q) return {0, -1};
  const int64_t d = i + diagonal(m, len_q, len_kv);
  int64_t lo = 0, hi = len_kv - 1;
  if (m.window_left >= 0 && d - m.window_left > lo) lo = d - m.window_left;
  if (m.causal && d < hi) hi = d;
  if (m.window_right >= 0 && d + m.window_right < hi) hi = d + m.window_right;
  return {lo, hi};
}

// Query rows of a sequence that see at least one key, as one range. Why one range: row i's band
// [max(0, u - wl), min(len_kv - 1, u (causal), u + wr)] with u = i + diag is non-empty exactly
// when len_kv > 0, its unclipped upper end is >= 0 (true from some row on) and its unclipped
// lower end is <= len_kv - 1 (true up to some row).
NVTE_HD KeyRange rows_with_keys(const MaskRule &m, int64_t len_q, int64_t len_kv) {
  if (len_q <= 0 || len_kv <= 0) return {0, -1};
  const int64_t diag = diagonal(m, len_q, len_kv);
  const bool upper = m.causal || m.window_right >= 0;
  const int64_t reach = m.causal ? 0 : m.window_right;  // the upper end is u + reach
  int64_t first = upper ? -(diag + reach) : 0, last = len_q - 1;
  if (first < 0) first = 0;
  if (m.window_left >= 0 && len_kv - 1 - diag + m.window_left < last) last = len_kv - 1 - diag + m.window_left;
  return {first, last};
}

// Keys seen by at least one query row, as one range: both ends of the bands grow by at most one
// per row, so consecutive non-empty bands touch or overlap and their union runs from the first
// such row's lower end to the last one's upper end.
NVTE_HD KeyRange keys_with_rows(const MaskRule &m, int64_t len_q, int64_t len_kv) {
  const KeyRange r = rows_with_keys(m, len_q, len_kv);
  if (r.lo > r.hi) return {0, -1};
  return {visible_keys(m, r.lo, len_q, len_kv).lo, visible_keys(m, r.hi, len_q, len_kv).hi};
}

// ALiBi term added to logit (i, j): -slope * |i + diag - j|.
NVTE_HD double alibi_term(double slope, int64_t i, int64_t j, int64_t diag) {
  const int64_t dist = i + diag - j;
  return -slope * static_cast<double>(dist < 0 ? -dist : dist);
}

// TE's default ALiBi slope of head h out of n_heads: with n the largest power of two
// <= n_heads, heads below n get 2^(-8 (h + 1) / n); the rest continue with the odd powers
// of 2^(-4 / n): 2^(-4 (2 (h - n) + 1) / n).
// (::exp2, not std::exp2: this runs in device code too.)
NVTE_HD double default_alibi_slope(size_t h, size_t n_heads) {
  size_t n = 1;
  while (n * 2 <= n_heads) n *= 2;
  if (h < n) return ::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(n));
  return ::exp2(-4.0 * static_cast<double>(2 * (h - n) + 1) / static_cast<double>(n));
}

// Dropout threshold: an element is kept when its 32-bit draw is >= this (keep prob 1 - p).
NVTE_HD uint32_t dropout_threshold(float p) {
  const double t = static_cast<double>(p) * 4294967296.0;
  return t >= 4294967295.0 ? 0xFFFFFFFFu : static_cast<uint32_t>(t);
}

// The four draws covering keys 4*(j/4) .. 4*(j/4)+3 of row i of head bh = b * H_q + h.
// Counter (j / 4, i, bh, low word of offset); key (seed low, seed high ^ offset high).
NVTE_HD Philox4x32 dropout_draws(uint64_t seed, uint64_t offset, uint64_t bh, uint64_t i,
                                 uint64_t j) {
  const Philox4x32 ctr{{static_cast<uint32_t>(j >> 2), static_cast<uint32_t>(i),
                        static_cast<uint32_t>(bh), static_cast<uint32_t>(offset)}};
  return philox4x32_10(ctr, static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32));
}

NVTE_HD bool dropout_keep(uint64_t seed, uint64_t offset, uint64_t bh, uint64_t i, uint64_t j,
                          uint32_t threshold) {
  return dropout_draws(seed, offset, bh, i, j).v[j & 3] >= threshold;
}

}  // namespace nvte::attn
