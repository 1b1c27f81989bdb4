// gemm_tuner.cpp - see gemm_tuner.h.
#include "gemm_tuner.h"

#include <algorithm>
#include <cstdio>

namespace nvte::cuda {

GemmTuner::GemmTuner(std::vector<cublasLtMatmulAlgo_t> candidates)
    : cand_(std::move(candidates)),
      ms_(cand_.size()),
      submitted_(cand_.size(), 0),
      live_(cand_.size(), true) {
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
      cudaGetLastError();
      abandon();
      return;
    }
    ms_[p.cand].push_back(t);
    spare_.push_back(p.start);
    spare_.push_back(p.stop);
  }
  pending_.erase(pending_.begin(), pending_.begin() + n);
}

void GemmTuner::decide() {
  std::vector<float> med(cand_.size(), -1.0f);
  for (size_t i = 0; i < cand_.size(); ++i) {
    if (!live_[i] || ms_[i].size() < (size_t)kSamples) continue;
    std::vector<float> s = ms_[i];
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    med[i] = s[s.size() / 2];
  }
  best_ = 0;
  for (size_t i = 1; i < cand_.size(); ++i)
    if (med[i] >= 0.0f && (med[best_] < 0.0f || med[i] < med[best_])) best_ = (int)i;
  // Another candidate replaces the heuristic's first choice only when clearly faster: a
  // difference within kMargin is not worth trusting from five single-call times.
  if (best_ != 0 && med[0] >= 0.0f && med[best_] > med[0] * (1.0f - kMargin)) best_ = 0;
  done_ = true;
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
  bool all_measured = true, all_queued = true;
  int pick = -1, queued = 0;
  for (size_t i = 0; i < cand_.size(); ++i) queued += submitted_[i];
  // Each round visits the candidates starting one further along: a call pattern with a
  // period of the candidate count (a sync every 8 calls, 8 candidates) would otherwise time
  // one candidate always right after the GPU idled (on the H100, in such a run, the candidate
  // always timed first measured slowest at 5 of 9 shapes).
  const size_t k = cand_.size(), first = (size_t)(queued / (int)k) % k;
  for (size_t j = 0; j < k; ++j) {
    const size_t i = (first + j) % k;
    if (!live_[i]) continue;
    all_measured &= ms_[i].size() >= (size_t)kSamples;
    if (submitted_[i] < kSamples) {
      all_queued = false;
      if (pick < 0 || submitted_[i] < submitted_[pick]) pick = (int)i;
    }
  }
  if (all_measured) {
    decide();
    return c;
  }
  if (all_queued) return c;  // waiting for events

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
      ++submitted_[call.cand];
    } else {
      cudaGetLastError();  // our own failure: not left for the caller to find
      abandon();
    }
    return;
  }
  spare_.push_back(call.start);
  spare_.push_back(call.stop);
  live_[call.cand] = false;
  if (call.cand == 0) abandon();  // the fallback itself is refused: the caller reports it
}

std::string GemmTuner::summary() const {
  std::string s;
  for (size_t i = 0; i < cand_.size(); ++i) {
    char buf[64];
    if (!live_[i]) {
      std::snprintf(buf, sizeof(buf), "%s#%zu refused", i ? ", " : "", i);
    } else if (ms_[i].size() >= (size_t)kSamples) {
      std::vector<float> v = ms_[i];
      std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
      std::snprintf(buf, sizeof(buf), "%s#%zu %.4f ms", i ? ", " : "", i, v[v.size() / 2]);
    } else {
      std::snprintf(buf, sizeof(buf), "%s#%zu unmeasured", i ? ", " : "", i);
    }
    s += buf;
  }
  return s;
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
