// cuda_check.h - host-side helpers of the CUDA backend that plain C++ files (cuBLASLt, cuDNN)
// share with the kernels: CUDA errors as NVTE_ERROR_CUDA statuses, pointer alignment.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "../common/error.h"

#define NVTE_CHECK_CUDA(call)                                                                   \
  do {                                                                                          \
    const cudaError_t err_ = (call);                                                            \
    if (err_ != cudaSuccess) NVTE_FAIL(NVTE_ERROR_CUDA, #call, " failed: ", cudaGetErrorName(err_), \
                                       " (", cudaGetErrorString(err_), ")");                    \
  } while (0)

// After a kernel launch: reports launch-configuration errors without synchronising.
#define NVTE_CHECK_LAUNCH() NVTE_CHECK_CUDA(cudaGetLastError())

namespace nvte::cuda {

// True when every pointer is aligned to `bytes` (decides vector vs scalar paths on the host).
inline bool aligned(const void *p, size_t bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

}  // namespace nvte::cuda
