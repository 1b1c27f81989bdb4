// gemm_tuner_schedule.h - GemmTuner's bookkeeping without CUDA: which candidate the next
// timed call runs, the finished samples, and the choice. Kept free of CUDA so that CI (no GPU)
// tests it (tests/unit/test_gemm_tuner_schedule.cpp).
//
// Candidate 0 is the heuristic's first choice, the reference: it is never scheduled on its own.
// Each timed call of candidate c >= 1 also times the first choice over the same inputs right
// after it, and its sample is the ratio of the two times. A paired ratio cancels what drifts
// between calls (clocks under the power limit, what else the GPU ran before), which made
// single-call times of different candidates disagree with their steady-state speed by several
// percent on the H100.
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace nvte::cuda {

class TunerSchedule {
 public:
  // candidates: how many, the first choice (0) included; samples: timed calls of each other
  // candidate; margin: how much faster (relative) a candidate must be to replace the first;
  // warmup: the plan's calls that run untimed before the first timed one (warming_up()).
  TunerSchedule(int candidates, int samples, float margin, int warmup = 0)
      : k_(candidates), samples_(samples), warmup_(warmup), margin_(margin), ratios_(candidates),
        queued_(candidates, 0), state_(candidates, State::live) {}

  // Counts one call of the plan; true while it is one of the first `warmup`. A timed call runs
  // the GEMM 2 x kRepeats times, so a shape is timed only once it has recurred: one seen a few
  // times (a varying token count, a last partial batch) never pays for timing it cannot use.
  bool warming_up() {
    if (seen_ >= warmup_) return false;
    ++seen_;
    return true;
  }

  // The candidate (>= 1) the next timed call runs, or -1 when every live candidate has all its
  // timed calls queued. Among those with the fewest queued calls, each round starts one
  // candidate further along, so that no candidate always follows the same one.
  int next() const {
    const int n = k_ - 1;
    if (n <= 0) return -1;
    int total = 0;
    for (int q : queued_) total += q;
    const int first = (total / n) % n;
    int pick = -1;
    for (int j = 0; j < n; ++j) {
      const int i = 1 + (first + j) % n;
      if (live(i) && queued_[i] < samples_ && (pick < 0 || queued_[i] < queued_[pick])) pick = i;
    }
    return pick;
  }
  void queued(int c) { ++queued_[c]; }
  // Never timed again nor chosen: cuBLASLt refused the candidate, or its output differed from
  // the first choice's on a checked call.
  void refused(int c) { state_[c] = State::refused; }
  void differs(int c) { state_[c] = State::differs; }
  bool live(int c) const { return state_[c] == State::live; }
  // One timed call of candidate c >= 1: its time and the first choice's in the same call.
  void sample(int c, float ms, float first_ms) {
    ratios_[c].push_back(first_ms > 0.0f ? ms / first_ms : 1e30f);
    first_ms_.push_back(first_ms);
  }

  // Every live candidate has its samples.
  bool measured() const {
    for (int i = 1; i < k_; ++i)
      if (live(i) && (int)ratios_[i].size() < samples_) return false;
    return true;
  }

  // The candidate with the lowest median ratio, if that is more than `margin` below 1 (a
  // smaller difference is not worth trusting from a few calls); else the first choice.
  int decide() const {
    int best = 0;
    for (int i = 1; i < k_; ++i) {
      const float r = ratio(i);
      if (r >= 0.0f && r < 1.0f - margin_ && (best == 0 || r < ratio(best))) best = i;
    }
    return best;
  }

  // Median time of candidate i over the first choice's (1 for the first choice), or -1 when
  // it is refused, differs or is not fully measured.
  float ratio(int i) const {
    if (i == 0) return 1.0f;
    if (!live(i) || (int)ratios_[i].size() < samples_) return -1.0f;
    return median(ratios_[i]);
  }

  // "#0 0.1234 ms, #1 x1.003, #2 refused, #3 differs, ..." for NVTE_GEMM_AUTOTUNE_LOG (#0: the
  // median of the first choice's paired times).
  std::string summary() const {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "#0 %.4f ms", first_ms_.empty() ? 0.0f : median(first_ms_));
    std::string out = buf;
    for (int i = 1; i < k_; ++i) {
      const float r = ratio(i);
      if (!live(i))
        std::snprintf(buf, sizeof(buf), ", #%d %s", i, state_[i] == State::refused ? "refused" : "differs");
      else if (r >= 0.0f)
        std::snprintf(buf, sizeof(buf), ", #%d x%.3f", i, r);
      else
        std::snprintf(buf, sizeof(buf), ", #%d unmeasured", i);
      out += buf;
    }
    return out;
  }

 private:
  static float median(std::vector<float> s) {
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    return s[s.size() / 2];
  }

  int k_, samples_, warmup_, seen_ = 0;
  float margin_;
  std::vector<std::vector<float>> ratios_;  // finished samples per candidate (index 0 unused)
  std::vector<float> first_ms_;             // the first choice's paired times, all calls
  std::vector<int> queued_;                 // timed calls launched per candidate
  enum class State : unsigned char { live, refused, differs };
  std::vector<State> state_;
};

}  // namespace nvte::cuda
