// fused_attn_seqlens.h - per-sequence lengths from cu_seqlens for cuDNN's padding masks.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace nvte::cuda {

// seq_q[i] = cu_q[i + 1] - cu_q[i] clamped to [0, max_q] (likewise kv), for i < batch, on stream.
void seqlens_from_cu(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv, size_t batch,
                     size_t max_q, size_t max_kv, cudaStream_t stream);

}  // namespace nvte::cuda
