// gemm_tuner.cpp - see gemm_tuner.h (the CUDA side: events, capture checks and the check
// flags; the choice itself is TunerSchedule's).
#include "gemm_tuner.h"

#include <mutex>

namespace nvte::cuda {
namespace {

// The tuners' check flags: one mapped, pinned host allocation for the process (freeing pinned
// memory can synchronise the device), handed out in slots of kCandidates ints. A process that
// tunes more than kPoolSlots plans at once runs the extra ones untuned.
constexpr int kPoolSlots = 256;
struct FlagPool {
  std::mutex mu;
  int *host = nullptr;
  int *dev = nullptr;
  bool failed = false;
  std::vector<int> free_slots;
};
FlagPool &flag_pool() {
  static FlagPool *p = new FlagPool;  // never destroyed: tuners may outlive static destructors
  return *p;
}

bool acquire_slot(int *slot, volatile int **host, int **dev) {
  FlagPool &p = flag_pool();
  std::lock_guard<std::mutex> lk(p.mu);
  if (p.host == nullptr && !p.failed) {
    void *h = nullptr, *d = nullptr;
    const size_t bytes = sizeof(int) * kPoolSlots * GemmTuner::kCandidates;
    if (cudaHostAlloc(&h, bytes, cudaHostAllocMapped | cudaHostAllocPortable) != cudaSuccess ||
        cudaHostGetDevicePointer(&d, h, 0) != cudaSuccess) {
      cudaGetLastError();  // our own failure: not left for the caller to find
      p.failed = true;
      return false;
    }
    p.host = static_cast<int *>(h);
    p.dev = static_cast<int *>(d);
    for (int i = kPoolSlots - 1; i >= 0; --i) p.free_slots.push_back(i);
  }
  if (p.free_slots.empty()) return false;
  *slot = p.free_slots.back();
  p.free_slots.pop_back();
  *host = p.host + *slot * GemmTuner::kCandidates;
  *dev = p.dev + *slot * GemmTuner::kCandidates;
  for (int i = 0; i < GemmTuner::kCandidates; ++i) (*host)[i] = 0;
  return true;
}

void release_slot(int slot) {
  FlagPool &p = flag_pool();
  std::lock_guard<std::mutex> lk(p.mu);
  p.free_slots.push_back(slot);
}

}  // namespace

GemmTuner::GemmTuner(std::vector<cublasLtMatmulAlgo_t> candidates, std::vector<int> index)
    : cand_(std::move(candidates)), index_(std::move(index)),
      sched_((int)cand_.size(), kSamples, kMargin, kWarmupCalls) {
  if (cand_.size() < 2) done_ = true;
}

void GemmTuner::poll() {
  size_t n = 0;
  for (; n < pending_.size(); ++n) {
    const Pending &p = pending_[n];
    const cudaError_t q = cudaEventQuery(p.ev[kChecked]);
    if (q == cudaErrorNotReady) break;  // not an error (and not recorded as the last one)
    float tc = 0.0f, t0 = 0.0f;
    if (q != cudaSuccess || cudaEventElapsedTime(&tc, p.ev[kCandStart], p.ev[kCandStop]) != cudaSuccess ||
        cudaEventElapsedTime(&t0, p.ev[kFirstStart], p.ev[kFirstStop]) != cudaSuccess) {
      cudaGetLastError();  // our own failure: not left for the caller to find
      abandon();
      return;
    }
    // the call's check kernel has run: its flag is final for this call
    if (flags_host_[p.cand] != 0) sched_.differs(p.cand);
    sched_.sample(p.cand, tc, t0);
    recycle(p.ev);
  }
  pending_.erase(pending_.begin(), pending_.begin() + n);
}

void GemmTuner::abandon() {
  best_ = 0;
  done_ = true;
}

bool GemmTuner::take_event(cudaEvent_t *e) {
  if (!spare_.empty()) {
    *e = spare_.back();
    spare_.pop_back();
    return true;
  }
  if (cudaEventCreate(e) == cudaSuccess) return true;
  cudaGetLastError();
  *e = nullptr;
  return false;
}

void GemmTuner::recycle(const cudaEvent_t *ev) {
  for (int i = 0; i < kEvents; ++i)
    if (ev[i]) spare_.push_back(ev[i]);
}

GemmTuner::Call GemmTuner::begin(cudaStream_t stream) {
  Call c;
  if (done_) return c;
  // During a graph capture: no event queries or records (the capture would record event
  // nodes, not times), no allocation; the current choice runs.
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    cudaGetLastError();
    return c;
  }
  if (cs != cudaStreamCaptureStatusNone) return c;
  if (sched_.warming_up()) return c;  // (before any event or flag slot is taken)
  if (slot_ < 0 && !acquire_slot(&slot_, &flags_host_, &flags_dev_)) {
    slot_ = -1;
    abandon();
    return c;
  }
  poll();
  if (done_) return c;
  if (sched_.measured()) {
    best_ = sched_.decide();
    done_ = measured_ = true;
    return c;
  }
  const int pick = sched_.next();
  if (pick < 0) return c;  // every timed call is queued: waiting for their events
  for (cudaEvent_t &e : c.ev)
    if (!take_event(&e)) {
      recycle(c.ev);
      abandon();
      return Call{};
    }
  c.cand = pick;
  return c;
}

bool GemmTuner::record(const Call &call, int i, cudaStream_t stream) {
  if (cudaEventRecord(call.ev[i], stream) == cudaSuccess) return true;
  cudaGetLastError();
  return false;
}

void GemmTuner::refused(const Call &call) {
  recycle(call.ev);
  sched_.refused(call.cand);
}

void GemmTuner::finish(const Call &call, bool ok) {
  if (!ok) {
    recycle(call.ev);
    abandon();
    return;
  }
  Pending p{call.cand, {}};
  for (int i = 0; i < kEvents; ++i) p.ev[i] = call.ev[i];
  pending_.push_back(p);
  sched_.queued(call.cand);
}

void GemmTuner::release() {
  bool failed = false;
  for (const Pending &p : pending_)
    for (cudaEvent_t e : p.ev) failed |= cudaEventDestroy(e) != cudaSuccess;
  for (cudaEvent_t e : spare_) failed |= cudaEventDestroy(e) != cudaSuccess;
  // A check still in flight (the tuner gave up) may yet write its flag: that slot is not reused.
  if (slot_ >= 0 && pending_.empty()) release_slot(slot_);
  slot_ = -1;
  pending_.clear();
  spare_.clear();
  if (failed) cudaGetLastError();
}

}  // namespace nvte::cuda
