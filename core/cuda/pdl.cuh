// pdl.cuh - programmatic dependent launch (sm_90+) for the memory-bound kernels.
//
// Back to back on one stream, a kernel normally starts only after the previous one has fully
// finished, and its blocks then take a few microseconds to launch and ramp up: on an H200 a
// ~30 us LayerNorm or cast measured ~3-4 us more per call back to back than its own duration
// (ncu). Launched with the programmatic-serialization attribute, a kernel's blocks may be
// scheduled while the previous kernel's last blocks still run; each block first executes
// griddepcontrol.wait, which returns once the previous kernel has completed and its writes are
// visible, so ordering is unchanged. Kernels launched this way call pdl_begin() before their
// first global memory access; it also signals launch_dependents, so that the next such kernel
// can be staged while this one finishes. On older GPUs the attribute is not set and
// pdl_begin() compiles to nothing.
#pragma once

#include <utility>

#include "common.cuh"

namespace nvte::cuda {

__device__ __forceinline__ void pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether the current device supports programmatic dependent launch (compute capability 9.0+).
bool pdl_supported();

// kernel<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization where
// supported. The kernel must begin with pdl_begin().
template <class... P, class... A>
void launch_pdl(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, A &&...args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl_supported() ? 1 : 0;
  NVTE_CHECK_CUDA(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...));
}

}  // namespace nvte::cuda
