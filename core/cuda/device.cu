// device.cu - device properties cached for launch-size decisions.
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <vector>

#include "common.cuh"
#include "pdl.cuh"

namespace nvte::cuda {

namespace {
__global__ void empty_fp8_scale_inv_kernel(const float *scale, float *si, float *csi, const float *noop) {
  if (noop != nullptr && *noop == 1.0f) return;
  const float inv = 1.0f / *scale;
  if (si != nullptr) *si = inv;
  if (csi != nullptr) *csi = inv;
}
}  // namespace

void write_empty_fp8_scale_inv(const float *scale, float *scale_inv, float *col_scale_inv, const float *noop,
                               cudaStream_t stream) {
  if (scale == nullptr || (scale_inv == nullptr && col_scale_inv == nullptr)) return;
  empty_fp8_scale_inv_kernel<<<1, 1, 0, stream>>>(scale, scale_inv, col_scale_inv, noop);
  NVTE_CHECK_LAUNCH();
}

int sm_count() {
  static std::mutex mu;
  static std::vector<int> counts;
  int dev = 0;
  NVTE_CHECK_CUDA(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  if ((int)counts.size() <= dev) counts.resize(dev + 1, 0);
  if (counts[dev] == 0) NVTE_CHECK_CUDA(cudaDeviceGetAttribute(&counts[dev], cudaDevAttrMultiProcessorCount, dev));
  return counts[dev];
}

bool pdl_supported() {
  static std::mutex mu;
  static std::vector<int> major;  // per device; 0 = not read yet
  int dev = 0;
  NVTE_CHECK_CUDA(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  if ((int)major.size() <= dev) major.resize(dev + 1, 0);
  if (major[dev] == 0) NVTE_CHECK_CUDA(cudaDeviceGetAttribute(&major[dev], cudaDevAttrComputeCapabilityMajor, dev));
  return major[dev] >= 9;
}

int resident_blocks(const void *kernel, int threads, size_t smem) {
  static std::mutex mu;
  static std::map<std::tuple<const void *, int, int, size_t>, int> cache;
  int dev = 0;
  NVTE_CHECK_CUDA(cudaGetDevice(&dev));
  const auto key = std::make_tuple(kernel, dev, threads, smem);
  std::lock_guard<std::mutex> lk(mu);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  if (smem > 0)  // with the kernel's static shared memory the 48 KiB default may be exceeded below smem
    NVTE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  int v = 0;
  NVTE_CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, threads, smem));
  NVTE_CHECK(v > 0, "internal: a kernel with ", threads, " threads and ", smem,
             " bytes of shared memory does not fit on an SM of device ", dev);
  return cache[key] = v;
}

void allow_dynamic_smem(const void *kernel, size_t max_smem) {
  static std::mutex mu;
  static std::set<std::tuple<const void *, int, size_t>> done;
  int dev = 0;
  NVTE_CHECK_CUDA(cudaGetDevice(&dev));
  std::lock_guard<std::mutex> lk(mu);
  if (done.count({kernel, dev, max_smem})) return;
  NVTE_CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)max_smem));
  done.insert({kernel, dev, max_smem});
}

}  // namespace nvte::cuda
