// gemm_tuner.cpp - see gemm_tuner.h (the CUDA side: events and capture checks; the choice
// itself is TunerSchedule's).
#include "gemm_tuner.h"

namespace nvte::cuda {

GemmTuner::GemmTuner(std::vector<cublasLtMatmulAlgo_t> candidates, std::vector<int> index)
    : cand_(std::move(candidates)), index_(std::move(index)), sched_((int)cand_.size(), kSamples, kMargin) {
  if (cand_.size() < 2) done_ = true;
}

void GemmTuner::poll() {
  size_t n = 0;
  for (; n < pending_.size(); ++n) {
    const Pending &p = pending_[n];
    const cudaError_t q = cudaEventQuery(p.stop);
    if (q == cudaErrorNotReady) break;  // not an error (and not recorded as the last one)
    float t = 0.0f;
    if (q != cudaSuccess || cudaEventElapsedTime(&t, p.start, p.stop) != cudaSuccess) {
      cudaGetLastError();  // our own failure: not left for the caller to find
      abandon();
      return;
    }
    sched_.sample(p.cand, t);
    spare_.push_back(p.start);
    spare_.push_back(p.stop);
  }
  pending_.erase(pending_.begin(), pending_.begin() + n);
}

void GemmTuner::abandon() {
  best_ = 0;
  done_ = true;
}

GemmTuner::Call GemmTuner::begin(cudaStream_t stream) {
  Call c;
  if (done_) return c;
  // During a graph capture: no event queries or records (the capture would record event
  // nodes, not times); the current choice runs.
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &cs) != cudaSuccess) {
    cudaGetLastError();
    return c;
  }
  if (cs != cudaStreamCaptureStatusNone) return c;
  poll();
  if (done_) return c;
  if (sched_.measured()) {
    best_ = sched_.decide();
    done_ = measured_ = true;
    return c;
  }
  const int pick = sched_.next();
  if (pick < 0) return c;  // every timed call is queued: waiting for their events

  cudaEvent_t ev[2];
  for (cudaEvent_t &e : ev) {
    if (!spare_.empty()) {
      e = spare_.back();
      spare_.pop_back();
    } else if (cudaEventCreate(&e) != cudaSuccess) {
      cudaGetLastError();
      abandon();
      return c;
    }
  }
  if (cudaEventRecord(ev[0], stream) != cudaSuccess) {
    cudaGetLastError();
    spare_.push_back(ev[0]);
    spare_.push_back(ev[1]);
    abandon();
    return c;
  }
  c.cand = pick;
  c.start = ev[0];
  c.stop = ev[1];
  return c;
}

void GemmTuner::end(const Call &call, cudaStream_t stream, bool ran) {
  if (call.cand < 0) return;
  if (ran) {
    if (cudaEventRecord(call.stop, stream) == cudaSuccess) {
      pending_.push_back({call.cand, call.start, call.stop});
      sched_.queued(call.cand);
    } else {
      cudaGetLastError();
      spare_.push_back(call.start);
      spare_.push_back(call.stop);
      abandon();
    }
    return;
  }
  spare_.push_back(call.start);
  spare_.push_back(call.stop);
  sched_.refused(call.cand);
  if (call.cand == 0) abandon();  // the fallback itself is refused: the caller reports it
}

void GemmTuner::release() {
  bool failed = false;
  for (const Pending &p : pending_) {
    failed |= cudaEventDestroy(p.start) != cudaSuccess;
    failed |= cudaEventDestroy(p.stop) != cudaSuccess;
  }
  for (cudaEvent_t e : spare_) failed |= cudaEventDestroy(e) != cudaSuccess;
  pending_.clear();
  spare_.clear();
  if (failed) cudaGetLastError();
}

}  // namespace nvte::cuda
