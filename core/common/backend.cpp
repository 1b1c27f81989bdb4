// backend.cpp - pointer classification for dispatch.
#include "backend.h"

#include <vector>

#ifdef NVTE_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace nvte {

namespace {
thread_local int t_call_depth = 0;       // nesting of api_call on this thread
thread_local int t_restore_device = -1;  // the caller's device while a call runs on another one

// Where a pointer lives; *device: its CUDA device (-1 for host memory).
Backend locate(const void *ptr, int *device) {
  *device = -1;
#ifdef NVTE_WITH_CUDA
  if (ptr == nullptr) return Backend::CPU;
  cudaPointerAttributes attr;
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error state for unregistered host memory
    return Backend::CPU;
  }
  if (attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged) {
    *device = attr.device;
    return Backend::CUDA;
  }
#else
  (void)ptr;
#endif
  return Backend::CPU;
}

// Makes `device` current for the rest of the call, remembering the caller's.
void use_device(int device) {
#ifdef NVTE_WITH_CUDA
  int current = -1;
  NVTE_CHECK(cudaGetDevice(&current) == cudaSuccess, "cudaGetDevice failed");
  if (current == device || device < 0) return;
  if (t_restore_device < 0) t_restore_device = current;
  const cudaError_t e = cudaSetDevice(device);
  NVTE_CHECK(e == cudaSuccess, "cudaSetDevice(", device, ") for the tensors' device failed: ", cudaGetErrorString(e));
#else
  (void)device;
#endif
}
}  // namespace

void begin_api_call() noexcept { ++t_call_depth; }

void end_api_call() noexcept {
  if (--t_call_depth > 0 || t_restore_device < 0) return;
#ifdef NVTE_WITH_CUDA
  cudaSetDevice(t_restore_device);
#endif
  t_restore_device = -1;
}

Backend pointer_backend(const void *ptr) {
  int device;
  return locate(ptr, &device);
}

Backend backend_of(const NamedTensor *tensors, size_t n) {
  const char *first_name = nullptr;
  const char *first_param = nullptr;
  Backend first = Backend::CPU;
  int first_device = -1;
  static const char *kParamNames[kNVTENumTensorParams] = {
      "data", "columnwise data", "scale", "amax", "scale_inv", "columnwise scale_inv", "columnwise amax"};
  for (size_t i = 0; i < n; ++i) {
    const NVTETensor t = tensors[i].second;
    if (t == nullptr) continue;
    for (int p = 0; p < kNVTENumTensorParams; ++p) {
      const void *ptr = t->params[p].data_ptr;
      if (ptr == nullptr) continue;
      int device;
      const Backend b = locate(ptr, &device);
      if (first_name == nullptr) {
        first = b;
        first_device = device;
        first_name = tensors[i].first;
        first_param = kParamNames[p];
      } else {
        NVTE_CHECK(b == first, "tensors live on different devices: ", first_name, " ", first_param,
                   " is in ", first == Backend::CUDA ? "CUDA device" : "host", " memory but ",
                   tensors[i].first, " ", kParamNames[p], " is in ",
                   b == Backend::CUDA ? "CUDA device" : "host", " memory");
        NVTE_CHECK(device == first_device, "tensors live on different CUDA devices: ", first_name, " ",
                   first_param, " is on device ", first_device, " but ", tensors[i].first, " ", kParamNames[p],
                   " is on device ", device);
      }
    }
  }
  if (first == Backend::CUDA) use_device(first_device);
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
