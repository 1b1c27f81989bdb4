// backend.h - the one place that decides where a call runs.
//
// Every entry point lists the tensors it touches; the backend is CUDA when their
// buffers are CUDA allocations and CPU when they are host memory. Mixing the two
// in one call is an error naming the offending tensor.
#pragma once

#include <initializer_list>
#include <utility>

#include "tensor.h"

namespace nvte {

enum class Backend { CPU, CUDA };

// Where one pointer lives (host unless this build has CUDA and the pointer is device memory).
Backend pointer_backend(const void *ptr);

// A named tensor for backend_of's messages; null handles are skipped.
using NamedTensor = std::pair<const char *, const NVTETensor>;

// Backend of all buffers of all listed tensors; throws on a host/device mix or on CUDA buffers
// of several devices. For CUDA it also makes the buffers' device current for the rest of the call
// (the caller's device is restored when the entry point returns: error.h's api_call).
Backend backend_of(std::initializer_list<NamedTensor> tensors);
Backend backend_of(const NamedTensor *tensors, size_t n);

// Throws NOT_SUPPORTED for ops whose CUDA kernels this build lacks.
[[noreturn]] void cuda_not_built(const char *op);

}  // namespace nvte
