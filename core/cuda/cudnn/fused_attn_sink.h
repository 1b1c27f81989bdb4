// fused_attn_sink.h - the gradient of the learnable softmax offset (the attention "sink" of
// NVTE_LEARNABLE_SOFTMAX) on the GPU, and the rescaling of a vanilla forward's output by the
// sink's share where cuDNN takes no sink token. cuDNN takes the offset as its sink token; the frontend's
// dSink graph (1.32) sums exp(sink - stats) * D over every row, padded ones included (statistics
// -inf there), with no minus sign, so the library computes the gradient itself from O, dO and the
// statistics.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "../../common/attn_layout.h"
#include "../../common/error.h"

namespace nvte::cuda {

// The rows of O (and dO) the kernels below walk, with their statistics and the offsets.
struct SinkRows {
  void *o = nullptr;                        // [.., h, d_v] rows of the output placement
  const void *d_o = nullptr;                // (the gradient only)
  NVTEDType dtype = kNVTEBFloat16;          // O and dO: float16 or bfloat16
  attn::TensorPlacement out{};              // O / dO row and head strides (elements), format
  size_t batch = 0, max_q = 0, heads = 0, d_v = 0;
  const float *stats = nullptr;             // [batch, heads, max_q]: log of each row's denominator
  const float *alpha = nullptr;             // [heads] the offsets
};

// Bytes of the partial sums softmax_offset_grad needs in its scratch (256-byte multiple).
size_t softmax_offset_grad_scratch_bytes(size_t heads);

// dalpha[h] = -sum over (b, i) of exp(alpha[h] - stats[b, h, i]) * sum_d dO[b, i, h, d] O[b, i, h, d]:
// the sink's share of row (b, i) times its softmax_sum D. Rows with statistics -inf (padding)
// contribute nothing. Deterministic: fixed-order partial sums per head in `scratch`, then one sum.
void softmax_offset_grad(const SinkRows &g, float *dalpha, void *scratch, cudaStream_t stream);

// A forward whose graph had no sink token (sink_rescale in fused_attn_cudnn_rules.h): each row of
// O is scaled by 1 / (1 + exp(alpha[h] - lse)), lse the vanilla graph's statistic of the row (the
// visible keys' share of the softmax with the sink); rows whose lse is -inf (padded, no key) stay.
void sink_rescale_rows(const SinkRows &r, cudaStream_t stream);

}  // namespace nvte::cuda
