// api/tensor_ops.cpp - whole-tensor utility entry points (nvte_zero_tensor).
#include <cstring>

#include "../common/backend.h"

using namespace nvte;

extern "C" {

NVTEStatus nvte_zero_tensor(const NVTETensor tensor, cudaStream_t stream) {
  (void)stream;
  return api_call("nvte_zero_tensor", [&] {
    NVTE_CHECK(tensor != nullptr, "tensor is a NULL tensor handle");
    switch (backend_of({{"tensor", tensor}})) {
      case Backend::CPU:
        for (int p = 0; p < kNVTENumTensorParams; ++p) {
          if (p == kNVTEScale) continue;  // the scale is recipe state, not tensor contents
          const NVTEBasicTensor &b = tensor->params[p];
          if (b.data_ptr == nullptr) continue;
          const size_t n = numel(b.shape);
          // FP4 packs two values per byte.
          const size_t bytes = b.dtype == kNVTEFloat4E2M1 ? (n + 1) / 2 : n * dtype_size(b.dtype);
          std::memset(b.data_ptr, 0, bytes);
        }
        return;
      case Backend::CUDA: cuda_not_built("nvte_zero_tensor");
    }
  });
}

}  // extern "C"
