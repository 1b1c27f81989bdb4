// cuda/attn_merge.h - CUDA backend of nvte_attn_merge / nvte_attn_merge_sink: the rule of
// common/attn_merge.h in float32 on `stream`.
#pragma once

#include <cuda_runtime.h>

#include "../common/attn_merge.h"
#include "../common/tensor.h"

namespace nvte::cuda {

void attn_merge(const attn_merge::Geometry &g, Tensor &out, Tensor &lse, const Tensor *out_part,
                const Tensor &lse_part, cudaStream_t stream);

// One block per head sums its rows in a fixed order (deterministic, no scratch).
void attn_merge_sink_grad(const attn_merge::Geometry &g, const Tensor &dout, const Tensor &out, const Tensor &lse,
                          const Tensor &sink, Tensor &dsink, cudaStream_t stream);

}  // namespace nvte::cuda
