// attn_merge.h - the validated geometry of one nvte_attn_merge / _merge_sink / _merge_sink_grad call
// (fused_attn.h) and the merge rule, shared by the CPU reference and the CUDA kernel.
//
// A context-parallel ring (or any split of the keys) attends with each block of keys on its own;
// the blocks' outputs combine through their softmax statistics: with lse the log of a row's
// softmax denominator, O = sum_i exp(lse_i - lse) O_i and lse = log sum_i exp(lse_i). The merge
// folds one more term into a running (out, lse) pair, in place.
#pragma once

#include <cmath>
#include <cstdint>

#include "numeric.h"

namespace nvte::attn_merge {

// Token (n, s) of a batch-n, row-s tensor sits at token index n * tok_n + s * tok_s (in units
// of heads * dim elements); its statistic for head h at n * lse_n + s * lse_s + h * lse_h.
struct Geometry {
  int64_t batch = 0;       // 1 for THD
  int64_t rows = 0;        // out's rows per batch entry (THD: tokens)
  int64_t part_rows = 0;   // the part's rows; part row j is out row row_offset + j
  int64_t row_offset = 0;
  int64_t heads = 0, dim = 0;
  int64_t out_tok_n = 0, out_tok_s = 0, part_tok_n = 0, part_tok_s = 0;
  int64_t lse_n = 0, lse_s = 0, lse_h = 0;        // running statistics
  int64_t plse_n = 0, plse_s = 0, plse_h = 0;     // the part's (sink: 0, 0, 1 over [heads])
  bool part_is_zero = false;                      // the sink: a term whose value is zero
};

// Weights of the running term (wa) and the new one (wb) and the new statistic, from the running
// statistic a and the new one b. Both -inf (no term so far, none added): returns false and the
// caller leaves the row alone. A NaN in either gives NaN weights and statistic (no silent value).
template <class F>
NVTE_HD bool merge_weights(F a, F b, F &wa, F &wb, F &lse) {
  if (a == -INFINITY && b == -INFINITY) return false;
  const F m = a > b ? a : b;  // (not fmax: a NaN must propagate)
  wa = exp(a - m);
  wb = exp(b - m);
  const F s = wa + wb;  // in [1, 2]
  lse = m + log(s);
  wa /= s;
  wb /= s;
  return true;
}

}  // namespace nvte::attn_merge
