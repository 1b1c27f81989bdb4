// cuda/cast.h - CUDA backend of the quantize / dequantize family (cast.h) and of the fused
// activation-backward + quantize + dbias ops (shared with transpose.h's dbias ops).
// Same contracts as core/cpu/cast.h; shapes, dtypes and buffers are validated by the API
// layer. Every call is asynchronous on `stream` and never reads device memory on the host.
#pragma once

#include <cstddef>
#include <optional>

#include "../common/activation_math.h"
#include "../common/tensor.h"

namespace nvte::cuda {

// out = quantize(in) into out's rowwise and/or columnwise layouts (one pass over in).
// noop: device float32 flag or null; when it holds 1 the kernel returns without writing.
void quantize(const Tensor &in, Tensor &out, const float *noop, cudaStream_t stream);

// quantize(*in[i], *out[i]) for i < n, in as few launches as the tensors' dtype pairs allow
// (multi_cast_transpose): consecutive tensors of one input/output dtype pair and one alignment
// class share a launch (up to tiles::kMaxMulti of them); empty ones get only their scale_inv.
void multi_quantize(size_t n, const Tensor *const *in, Tensor *const *out, cudaStream_t stream);

// out = float(in) * in.scale_inv; in may hold only columnwise data.
void dequantize(const Tensor &in, Tensor &out, cudaStream_t stream);

// Bytes of float32 partial column sums quantize_dbias needs for a [rows, cols] input.
size_t dbias_workspace_bytes(size_t rows, size_t cols);

// g = in * dact(act_in) (g = in when act is empty); out = quantize(g) in all of out's layouts;
// dbias = column sums of g in a fixed order (deterministic), stored in dbias's dtype.
// workspace: at least dbias_workspace_bytes(rows, cols) bytes of device memory, 4-byte aligned.
void quantize_dbias(const Tensor &in, const Tensor *act_in, std::optional<Act> act, Tensor &out,
                    Tensor &dbias, void *workspace, cudaStream_t stream);

}  // namespace nvte::cuda
