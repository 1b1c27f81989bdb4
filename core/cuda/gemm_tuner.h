// gemm_tuner.h - picking among cuBLASLt's candidate algorithms for one GEMM plan by timing
// the caller's own calls (NVTE_GEMM_AUTOTUNE=1; opt-in, see gemm.cpp).
//
// cuBLASLt's heuristic ranks its algorithms with a model; its first choice is what cuBLAS
// and torch run. On the H100 another of its top candidates was 3-10% faster for several
// Linear shapes (benchmarks/RESULTS.md, 2026-11-25), with bit-identical output there (not
// at every shape). A plan with a tuner runs its first calls over the candidates, each between
// two CUDA events; it reads an event pair only once both have completed (cudaEventQuery,
// never a wait) and, when every candidate has kSamples times, keeps the choice of
// TunerSchedule::decide (the lowest median; the first choice unless another is kMargin
// faster). No synchronisation, no extra launches (the timed calls are the caller's), and no
// timing on a stream that is being captured into a CUDA graph. Not thread-safe: the plan's
// mutex guards it.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <string>
#include <vector>

#include "gemm_tuner_schedule.h"

namespace nvte::cuda {

class GemmTuner {
 public:
  static constexpr int kSamples = 5;       // timed calls per candidate
  static constexpr int kCandidates = 8;    // heuristic results asked for
  static constexpr float kMargin = 0.01f;  // a candidate must be this much faster than the first

  // candidates[0] is the heuristic's first choice, used until the tuner decides; index[i] is
  // candidate i's position in the heuristic's list (for the cache file and the log).
  GemmTuner(std::vector<cublasLtMatmulAlgo_t> candidates, std::vector<int> index);
  GemmTuner(const GemmTuner &) = delete;
  GemmTuner &operator=(const GemmTuner &) = delete;

  struct Call {
    int cand = -1;  // the candidate this call runs and times; -1: run the current choice
    cudaEvent_t start = nullptr, stop = nullptr;
  };
  // Collects the finished samples, then either decides (done() becomes true), or returns the
  // candidate to run in this call with its start event recorded on `stream`.
  Call begin(cudaStream_t stream);
  // After the matmul of a timed call: records its stop event, or, when cuBLASLt refused the
  // candidate (ran = false), drops that candidate for good.
  void end(const Call &call, cudaStream_t stream, bool ran);

  const cublasLtMatmulAlgo_t &algo(int i) const { return cand_[i]; }
  int heuristic_index(int i) const { return index_[i]; }
  bool done() const { return done_; }
  bool measured() const { return measured_; }  // done from timings (not given up on an event error)
  int best() const { return best_; }
  std::string summary() const { return sched_.summary(); }
  // Destroys the CUDA events (call once done, while the runtime is alive; the destructor
  // does not touch CUDA, so a tuner still pending at process exit is simply left).
  void release();

 private:
  struct Pending {
    int cand;
    cudaEvent_t start, stop;
  };
  void poll();
  void abandon();  // a CUDA event call failed: keep the heuristic's choice

  std::vector<cublasLtMatmulAlgo_t> cand_;
  std::vector<int> index_;
  TunerSchedule sched_;
  std::vector<Pending> pending_;    // queued, oldest first
  std::vector<cudaEvent_t> spare_;  // recycled events
  bool done_ = false, measured_ = false;
  int best_ = 0;
};

}  // namespace nvte::cuda
