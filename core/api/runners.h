// runners.h - validation + dispatch shared by several entry-point files (defined in api/cast.cpp):
// cast+transpose ops are quantizations into an output with a columnwise layout, and the
// recipe's current-scaling ops honour the same noop flag, so they all validate alike.
#pragma once

#include <optional>

#include "../common/activation_math.h"
#include "../common/backend.h"

namespace nvte::api {

// True when a noop flag tensor (float32[1]) holds 1: TE's "skip this op" signal. CPU only
// (it reads the flag on the host).
bool noop_set(const NVTETensor noop, Backend b);

// The validated data pointer of a noop flag tensor (null when absent), for kernels that test
// the flag on the device.
const float *noop_ptr(const NVTETensor noop);

// The checks the CPU's OutputRows makes on an output of rows x cols (dtype, layouts' shapes,
// FP8 needs a scale, float32 scalar buffers), without reading any buffer: for the CUDA path.
void check_output(const Tensor &out, const char *name, size_t rows, size_t cols);

void run_quantize(const char *op, const NVTETensor input, NVTETensor output, const NVTETensor noop,
                  cudaStream_t stream);

// act empty: plain dbias; otherwise g = input * dact(act_input) first.
void run_quantize_dbias(const char *op, const NVTETensor input, const NVTETensor act_input,
                        NVTETensor output, NVTETensor dbias, NVTETensor workspace,
                        std::optional<Act> act, cudaStream_t stream);

}  // namespace nvte::api
