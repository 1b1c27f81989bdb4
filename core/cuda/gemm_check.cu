// gemm_check.cu - the kernels that check a GEMM autotune candidate against the heuristic's
// first choice (gemm_tuner.h). A candidate may replace the first choice only if its outputs
// are bit-identical on every checked call, so each output buffer is hashed after the
// candidate's run and again after the first choice's run over the same inputs. The hash is a
// sum modulo 2^64 of a mixed (position, 16-byte word) value per word: the sum's order does
// not matter (one atomic per warp, any grid), any changed bit changes the terms, and the
// check costs one read of the outputs. A single thread compares the two sums and sets the
// candidate's flag in mapped host memory, which the tuner reads once the call's last event has
// completed: no host synchronisation.
#include "common.cuh"
#include "gemm.h"

namespace nvte::cuda {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

__device__ __forceinline__ uint64_t term(uint64_t pos, uint64_t word, uint64_t salt) {
  return mix64(word ^ mix64(pos * 0x9e3779b97f4a7c15ull + salt));
}

// words: 16-byte words when the buffer is 16-byte aligned (the tail bytes one by one), else
// every byte is a word of its own.
__global__ void hash_kernel(const unsigned char *p, size_t bytes, bool vec, uint64_t salt,
                            unsigned long long *sum) {
  uint64_t h = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  size_t done = 0;
  if (vec) {
    const size_t nv = bytes / 16;
    const uint4 *v = reinterpret_cast<const uint4 *>(p);
    for (size_t j = i; j < nv; j += stride) {
      const uint4 w = v[j];
      const uint64_t lo = ((uint64_t)w.y << 32) | w.x, hi = ((uint64_t)w.w << 32) | w.z;
      h += term(2 * j, lo, salt) + term(2 * j + 1, hi, salt);
    }
    done = nv * 16;
  }
  for (size_t j = done + i; j < bytes; j += stride) h += term(j, p[j] | 0x100ull, salt ^ 0x5bd1e995ull);
  for (int o = 16; o > 0; o >>= 1) h += __shfl_down_sync(0xffffffffu, h, o);
  if ((threadIdx.x & 31) == 0 && h != 0) atomicAdd(sum, (unsigned long long)h);
}

__global__ void compare_kernel(const unsigned long long *sums, int *flag) {
  if (sums[0] != sums[1]) *flag = 1;
}

}  // namespace

bool launch_output_hash(const void *data, size_t bytes, uint64_t salt, unsigned long long *sum,
                        cudaStream_t stream) {
  if (bytes == 0) return true;
  constexpr int kThreads = 256;
  const bool vec = aligned(data, 16);
  hash_kernel<<<grid_for(vec ? bytes / 16 + 1 : bytes, kThreads), kThreads, 0, stream>>>(
      static_cast<const unsigned char *>(data), bytes, vec, salt, sum);
  return cudaGetLastError() == cudaSuccess;
}

bool launch_hash_compare(const unsigned long long *sums, int *flag, cudaStream_t stream) {
  compare_kernel<<<1, 1, 0, stream>>>(sums, flag);
  return cudaGetLastError() == cudaSuccess;
}

}  // namespace nvte::cuda
