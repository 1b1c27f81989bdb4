// backend.cpp - pointer classification for dispatch.
#include "backend.h"

#include <vector>

#ifdef NVTE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nvte {

Backend pointer_backend(const void *ptr) {
#ifdef NVTE_WITH_CUDA
  if (ptr == nullptr) return Backend::CPU;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state for unregistered host memory
    return Backend::CPU;
  }
  return (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) ? Backend::CUDA
                                                                                    : Backend::CPU;
#else
  (void)ptr;
  return Backend::CPU;
#endif
}

Backend backend_of(const NamedTensor *tensors, size_t n) {
  const char *first_name = nullptr;
  const char *first_param = nullptr;
  Backend first = Backend::CPU;
  static const char *kParamNames[kNVTENumTensorParams] = {
      "data", "columnwise data", "scale", "amax", "scale_inv", "columnwise scale_inv", "columnwise amax"};
  for (size_t i = 0; i < n; ++i) {
    const NVTETensor t = tensors[i].second;
    if (t == nullptr) continue;
    for (int p = 0; p < kNVTENumTensorParams; ++p) {
      const void *ptr = t->params[p].data_ptr;
      if (ptr == nullptr) continue;
      const Backend b = pointer_backend(ptr);
      if (first_name == nullptr) {
        first = b;
        first_name = tensors[i].first;
        first_param = kParamNames[p];
      } else {
        NVTE_CHECK(b == first, "tensors live on different devices: ", first_name, " ", first_param,
                   " is in ", first == Backend::CUDA ? "CUDA device" : "host", " memory but ",
                   tensors[i].first, " ", kParamNames[p], " is in ",
                   b == Backend::CUDA ? "CUDA device" : "host", " memory");
      }
    }
  }
  return first;
}

Backend backend_of(std::initializer_list<NamedTensor> tensors) {
  return backend_of(tensors.begin(), tensors.size());
}

void cuda_not_built(const char *op) {
  NVTE_FAIL(NVTE_ERROR_NOT_SUPPORTED, op,
            " got CUDA device tensors, but its CUDA kernel is not part of this build yet");
}

}  // namespace nvte

extern "C" {
int nvte_cuda_backend_available(void) {
#ifdef NVTE_WITH_CUDA
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n > 0;
#else
  return 0;
#endif
}

NVTEBackend nvte_pointer_backend(const void *ptr) {
  return nvte::pointer_backend(ptr) == nvte::Backend::CUDA ? kNVTEBackendCUDA : kNVTEBackendCPU;
}

int nvte_is_non_tn_fp8_gemm_supported(void) {
  // The CPU backend handles every layout. cuBLASLt's FP8 GEMMs take only the TN layout on
  // Ada (sm_89), Hopper (sm_90) and consumer Blackwell (sm_12x); sm_100+ takes all four.
#ifdef NVTE_WITH_CUDA
  int n = 0, dev = 0, major = 0, minor = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0 || cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) {
    cudaGetLastError();
    return 1;  // no usable device: only the CPU backend runs
  }
  return (major == 8 && minor == 9) || major == 9 || major == 12 ? 0 : 1;
#else
  return 1;
#endif
}
}
