// gemm_tuner.h - picking among cuBLASLt's candidate algorithms for one GEMM plan by timing
// the caller's own calls (on by default for large shapes, see gemm_autotune.h), from the
// plan's 17th call on (kWarmupCalls: shapes that do not recur are never timed).
//
// cuBLASLt's heuristic ranks its algorithms with a model; its first choice is what cuBLAS
// and torch run. On the H100 another of its top candidates was 3-10% faster for several
// Linear shapes (benchmarks/RESULTS.md, 2026-11-25). A plan with a tuner runs its calls after
// the warm-up over the other candidates. Such a call runs candidate c twice back to back
// between two CUDA events, then the first choice twice between two more (paired timing:
// TunerSchedule; twice, because a kernel timed alone ran at a different speed than in a stream
// of GEMMs, which is how a model runs them). The tuner reads a call's events only once its last one has completed
// (cudaEventQuery, never a wait) and, when every candidate has kSamples calls, keeps the choice
// of TunerSchedule::decide. The tuner never waits, and does not time on a stream that is being
// captured into a CUDA graph; but a candidate's first run blocks the host until the device is
// idle (cuBLASLt loads that kernel then; seen on an H100 with lazy and eager module loading
// alike), so tuning costs a plan about one such wait per candidate, once per process.
//
// Tuning must not change results: some candidates round differently from the first choice
// (seen on the H100 at small shapes). So the outputs are hashed after the candidate's runs and
// again after the first choice's (the call's result is always the first choice's), and a device
// kernel sets c's flag in mapped host memory when the hashes differ. A flagged candidate is
// dropped (TunerSchedule::differs). Not thread-safe: the plan's mutex guards it.
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
  static constexpr int kRepeats = 2;       // back-to-back runs of each algorithm in a timed call
  static constexpr int kCandidates = 8;    // heuristic results asked for
  static constexpr float kMargin = 0.01f;  // a candidate must be this much faster than the first
  static constexpr int kWarmupCalls = 16;  // untimed calls before the first timed one (TunerSchedule)

  // candidates[0] is the heuristic's first choice, used until the tuner decides; index[i] is
  // candidate i's position in the heuristic's list (for the cache file and the log).
  GemmTuner(std::vector<cublasLtMatmulAlgo_t> candidates, std::vector<int> index);
  GemmTuner(const GemmTuner &) = delete;
  GemmTuner &operator=(const GemmTuner &) = delete;

  // The events of a timed call, in stream order: candidate start / stop, first choice start /
  // stop, and the end of the check.
  enum { kCandStart, kCandStop, kFirstStart, kFirstStop, kChecked, kEvents };
  struct Call {
    int cand = -1;  // the candidate (>= 1) this call times; -1: run the current choice only
    cudaEvent_t ev[kEvents] = {};
  };
  // Collects the finished samples, then either decides (done() becomes true), or returns the
  // candidate to time in this call with its (unrecorded) events.
  Call begin(cudaStream_t stream);
  // Records event i of the call on `stream`; false when that failed (the error is consumed).
  bool record(const Call &call, int i, cudaStream_t stream);
  // cuBLASLt refused the candidate: dropped for good (the call's events are recycled).
  void refused(const Call &call);
  // After the call's launches; ok = false: one failed, and the tuner gives up (the first
  // choice stays).
  void finish(const Call &call, bool ok);
  // Device pointer to candidate c's flag, for the kernel that compares the hashes (c >= 1).
  int *check_flag(int c) const { return flags_dev_ + c; }

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
    cudaEvent_t ev[kEvents];
  };
  void poll();
  void abandon();  // a CUDA call failed: keep the heuristic's choice
  bool take_event(cudaEvent_t *e);
  void recycle(const cudaEvent_t *ev);

  std::vector<cublasLtMatmulAlgo_t> cand_;
  std::vector<int> index_;
  TunerSchedule sched_;
  std::vector<Pending> pending_;    // queued, oldest first
  std::vector<cudaEvent_t> spare_;  // recycled events
  int slot_ = -1;                   // this tuner's flags in the shared mapped-memory pool
  volatile int *flags_host_ = nullptr;
  int *flags_dev_ = nullptr;
  bool done_ = false, measured_ = false;
  int best_ = 0;
};

}  // namespace nvte::cuda
