// fused_attn_seqlens.h - small device helpers of the cuDNN attention backend: per-sequence
// lengths from cu_seqlens for cuDNN's padding masks, and the float32 scalar bookkeeping of the FP8
// graphs (descales computed as 1/scale before a graph runs, amax folding and scale_inv after).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../../common/error.h"

namespace nvte::cuda {

// seq_q[i] = cu_q[i + 1] - cu_q[i] clamped to [0, max_q] (likewise kv), for i < batch, on stream.
void seqlens_from_cu(const int32_t *cu_q, const int32_t *cu_kv, int32_t *seq_q, int32_t *seq_kv, size_t batch,
                     size_t max_q, size_t max_kv, cudaStream_t stream);

// One float32 scalar operation on device pointers:
//   kSet:     *dst = src ? *src : 1.0f       (a scale to bind, or 1 for a float16/bfloat16 output)
//   kRecip:   *dst = 1.0f / *src             (correctly rounded, as the CPU's 1.0f / scale)
//   kFoldMax: *dst = fmaxf(*dst, *src)       (amax max-accumulation; NaN-ignoring like std::fmax)
//   kFoldUnit: *dst = fmaxf(*dst, *src > 0 ? 1 : 0)  (S's amax: see fused_attn_cudnn.cpp fp8_fwd)
// A null dst skips the entry (an optional buffer the caller did not give).
struct ScalarOp {
  enum Kind : int { kSet = 0, kRecip = 1, kFoldMax = 2, kFoldUnit = 3 };
  float *dst = nullptr;
  const float *src = nullptr;
  int kind = kSet;
};
constexpr int kMaxScalarOps = 16;
struct ScalarOps {
  ScalarOp op[kMaxScalarOps];
  int n = 0;
  void add(float *dst, const float *src, int kind) {
    NVTE_CHECK(n < kMaxScalarOps, "internal: more than ", kMaxScalarOps, " FP8 scalar operations in one launch");
    op[n++] = ScalarOp{dst, src, kind};
  }
};

// Runs the operations in order in one tiny launch on stream; no host synchronization.
void run_scalar_ops(const ScalarOps &ops, cudaStream_t stream);

}  // namespace nvte::cuda
