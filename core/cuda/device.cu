// device.cu - device properties cached for launch-size decisions.
#include <mutex>
#include <vector>

#include "common.cuh"

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

}  // namespace nvte::cuda
