// rope.h - the validated geometry of one fused_rope.h call and the pair rule, shared by the CPU
// reference and the CUDA kernel so both index and pair elements the same way.
#pragma once

#include <cstdint>

#include "numeric.h"  // NVTE_HD
#include "thd_rows.h"

namespace nvte::rope {

struct RopeParams {
  bool thd = false, interleaved = false, backward = false;
  bool bshd = false;           // (SBHD otherwise, when not THD)
  int64_t rows = 0;            // s * b (SBHD/BSHD) or t (THD): one row = h * d elements
  int64_t s = 0, b = 0, h = 0, d = 0, d2 = 0;
  int64_t stride_t = 0, stride_b = 0, stride_h = 0, stride_d = 0;  // of the strided tensor read
  int64_t freq_rows = 0;       // positions freqs covers
  int64_t cp_size = 1, cp_rank = 0;  // context parallelism: this rank's share of each sequence
};

// Row r of the dense output: (sequence index in the batch, row within it) for SBHD / BSHD.
NVTE_HD void dense_row(const RopeParams &p, int64_t r, int64_t &seq, int64_t &pos) {
  if (p.bshd) {
    seq = r / p.s;
    pos = r % p.s;
  } else {
    seq = r % p.b;
    pos = r / p.b;
  }
}

// Context parallelism splits each sequence of n = cp_size * len tokens into 2 cp_size equal chunks
// and gives rank k chunks k and 2 cp_size - 1 - k (so causal attention work is balanced), back to
// back: local row j < len/2 is at position k len/2 + j, the rest at (2 cp_size - 1 - k) len/2 +
// (j - len/2). len must be even (checked where it is known).
NVTE_HD int64_t cp_position(const RopeParams &p, int64_t j, int64_t len) {
  if (p.cp_size == 1) return j;
  const int64_t half = len / 2;
  return j < half ? p.cp_rank * half + j : (2 * p.cp_size - 1 - p.cp_rank) * half + (j - half);
}

// Row r of the output: its sequence (seq; -1 for a THD row of no sequence) and position before
// start_positions. THD with cp_size > 1: cu_seqlens holds the whole sequences' offsets, so this
// rank's rows of sequence i are [cu[i] / cp_size, cu[i + 1] / cp_size). Returns false when the
// row's THD sequence cannot be split that way (cu[i] not a multiple of cp_size or its length not a
// multiple of 2 cp_size); the CPU reports it, the GPU writes NaN.
NVTE_HD bool row_position(const RopeParams &p, const int32_t *cu, int64_t r, int64_t &seq, int64_t &pos) {
  int64_t j, len;
  if (p.thd) {
    seq = thd_sequence_of_row(cu, p.b, r * p.cp_size);
    if (seq < 0) {
      pos = 0;
      return true;
    }
    const int64_t lo = cu[seq], n = cu[seq + 1] - lo;
    if (p.cp_size > 1 && (lo % p.cp_size != 0 || n % (2 * p.cp_size) != 0)) {
      pos = 0;
      return false;
    }
    j = r - lo / p.cp_size;
    len = n / p.cp_size;
  } else {
    dense_row(p, r, seq, j);
    len = p.s;
  }
  pos = cp_position(p, j, len);
  return true;
}

// Element offset of (row r, head hh, channel k) in the strided input.
NVTE_HD int64_t src_offset(const RopeParams &p, int64_t r, int64_t hh, int64_t k) {
  int64_t base;
  if (p.thd) {
    base = r * p.stride_t;
  } else {
    int64_t seq, pos;
    dense_row(p, r, seq, pos);
    base = pos * p.stride_t + seq * p.stride_b;
  }
  return base + hh * p.stride_h + k * p.stride_d;
}

// The pair rule of fused_rope.h for channels (k, p) with s(k) = -1 (non-interleaved: p = k + d2/2,
// k < d2/2; interleaved: p = k + 1, k even), angles' cos/sin at k and p: forward
// (a cos_k - b sin_k, b cos_p + a sin_p), backward (a cos_k + b sin_p, b cos_p - a sin_k).
template <class F>
NVTE_HD void rotate_pair(bool backward, F a, F b, F ck, F sk, F cp, F sp, F &oa, F &ob) {
  oa = backward ? a * ck + b * sp : a * ck - b * sk;
  ob = backward ? b * cp - a * sk : b * cp + a * sp;
}

// The channel paired with k (k < d2, the pair's first: k < d2/2, or even when interleaved).
NVTE_HD int64_t pair_of(const RopeParams &p, int64_t k) { return p.interleaved ? k + 1 : k + p.d2 / 2; }

}  // namespace nvte::rope
