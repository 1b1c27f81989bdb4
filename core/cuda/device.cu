// device.cu - device properties cached for launch-size decisions.
#include <mutex>
#include <vector>

#include "common.cuh"
#include "pdl.cuh"

namespace nvte::cuda {

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

}  // namespace nvte::cuda
