// cpu/attn_merge.h - CPU reference of nvte_attn_merge / _merge_sink / _merge_sink_grad (fused_attn.h).
#pragma once

#include "../common/attn_merge.h"
#include "../common/tensor.h"

namespace nvte::cpu {

// Folds the part (out_part rows and their statistics; part null: the sink, a zero value with the
// per-head statistic lse_part[h]) into out / lse in place, row by row, in double precision.
void attn_merge(const attn_merge::Geometry &g, Tensor &out, Tensor &lse, const Tensor *out_part,
                const Tensor &lse_part);

// dsink[h] = -sum over rows of exp(sink[h] - lse) (dO . O), in double precision, rows in order.
void attn_merge_sink_grad(const attn_merge::Geometry &g, const Tensor &dout, const Tensor &out, const Tensor &lse,
                          const Tensor &sink, Tensor &dsink);

}  // namespace nvte::cpu
