// api/tensor_ops.cpp - whole-tensor utility entry points (nvte_zero_tensor).
#include <cstring>

#include "../common/backend.h"
#ifdef NVTE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

using namespace nvte;

extern "C" {

NVTEStatus nvte_zero_tensor(const NVTETensor tensor, cudaStream_t stream) {
  return api_call("nvte_zero_tensor", [&] {
    NVTE_CHECK(tensor != nullptr, "tensor is a NULL tensor handle");
    const Backend backend = backend_of({{"tensor", tensor}});
#ifndef NVTE_WITH_CUDA
    if (backend == Backend::CUDA) cuda_not_built("nvte_zero_tensor");
#endif
    for (int p = 0; p < kNVTENumTensorParams; ++p) {
      if (p == kNVTEScale) continue;  // the scale is recipe state, not tensor contents
      const NVTEBasicTensor &b = tensor->params[p];
      if (b.data_ptr == nullptr) continue;
      const size_t n = numel(b.shape);
      // FP4 packs two values per byte.
      const size_t bytes = b.dtype == kNVTEFloat4E2M1 ? (n + 1) / 2 : n * dtype_size(b.dtype);
      if (bytes == 0) continue;
      switch (backend) {
        case Backend::CPU: std::memset(b.data_ptr, 0, bytes); break;
        case Backend::CUDA: {
#ifdef NVTE_WITH_CUDA
          const cudaError_t err = cudaMemsetAsync(b.data_ptr, 0, bytes, stream);
          if (err != cudaSuccess)
            NVTE_FAIL(NVTE_ERROR_CUDA, "cudaMemsetAsync of ", bytes, " bytes failed: ", cudaGetErrorName(err), " (",
                      cudaGetErrorString(err), ")");
#endif
          break;
        }
      }
    }
  });
}

}  // extern "C"
