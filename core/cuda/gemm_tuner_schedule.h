// gemm_tuner_schedule.h - GemmTuner's bookkeeping without CUDA: which candidate the next
// timed call runs, the finished samples, and the choice. Kept free of CUDA so that CI (no GPU)
// tests it (tests/unit/test_gemm_tuner_schedule.cpp).
#pragma once

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace nvte::cuda {

class TunerSchedule {
 public:
  // candidates: how many (0 = the heuristic's first choice); samples: timed calls each;
  // margin: how much faster (relative) another candidate must be to replace the first.
  TunerSchedule(int candidates, int samples, float margin)
      : k_(candidates), samples_(samples), margin_(margin), ms_(candidates), queued_(candidates, 0),
        live_(candidates, true) {}

  // The candidate the next timed call runs, or -1 when every live candidate has all its timed
  // calls queued. Among those with the fewest queued calls, each round starts one candidate
  // further along: a call pattern with a period of k (a sync every k calls) would otherwise
  // time one candidate always right after the GPU idled (on the H100, in such a run, the
  // candidate always timed first measured slowest at 5 of 9 shapes).
  int next() const {
    int total = 0;
    for (int q : queued_) total += q;
    const int first = k_ > 0 ? (total / k_) % k_ : 0;
    int pick = -1;
    for (int j = 0; j < k_; ++j) {
      const int i = (first + j) % k_;
      if (live_[i] && queued_[i] < samples_ && (pick < 0 || queued_[i] < queued_[pick])) pick = i;
    }
    return pick;
  }
  void queued(int c) { ++queued_[c]; }
  void refused(int c) { live_[c] = false; }  // never timed again nor chosen
  void sample(int c, float ms) { ms_[c].push_back(ms); }
  bool live(int c) const { return live_[c]; }

  // Every live candidate has its samples.
  bool measured() const {
    for (int i = 0; i < k_; ++i)
      if (live_[i] && (int)ms_[i].size() < samples_) return false;
    return true;
  }

  // The lowest median among the measured live candidates; the first choice (0) unless that
  // median is more than `margin` below the first's (a smaller difference is not worth
  // trusting from a few single-call times).
  int decide() const {
    int best = -1;
    for (int i = 0; i < k_; ++i) {
      const float m = median(i);
      if (m >= 0.0f && (best < 0 || m < median(best))) best = i;
    }
    if (best < 0) return 0;
    const float first = median(0);
    if (best != 0 && first >= 0.0f && median(best) > first * (1.0f - margin_)) return 0;
    return best;
  }

  // Median ms of candidate i, or -1 when it is refused or not fully measured.
  float median(int i) const {
    if (!live_[i] || (int)ms_[i].size() < samples_) return -1.0f;
    std::vector<float> s = ms_[i];
    std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
    return s[s.size() / 2];
  }

  // "#0 0.1234 ms, #1 refused, ..." for NVTE_GEMM_AUTOTUNE_LOG.
  std::string summary() const {
    std::string out;
    for (int i = 0; i < k_; ++i) {
      char buf[64];
      const float m = median(i);
      if (!live_[i])
        std::snprintf(buf, sizeof(buf), "%s#%d refused", i ? ", " : "", i);
      else if (m >= 0.0f)
        std::snprintf(buf, sizeof(buf), "%s#%d %.4f ms", i ? ", " : "", i, m);
      else
        std::snprintf(buf, sizeof(buf), "%s#%d unmeasured", i ? ", " : "", i);
      out += buf;
    }
    return out;
  }

 private:
  int k_, samples_;
  float margin_;
  std::vector<std::vector<float>> ms_;  // finished samples per candidate
  std::vector<int> queued_;             // timed calls launched per candidate
  std::vector<bool> live_;              // false: cuBLASLt refused it
};

}  // namespace nvte::cuda
