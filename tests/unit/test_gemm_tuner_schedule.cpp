// TunerSchedule (core/cuda/gemm_tuner_schedule.h): the order of GemmTuner's timed calls and
// its choice, without a GPU. Run by ctest.
#include "check.h"
#include "../../core/cuda/gemm_tuner_schedule.h"

#include <cstdio>
#include <cstdlib>
#include <vector>

using nvte::cuda::TunerSchedule;

// Queues every timed call the schedule hands out; returns the order.
static std::vector<int> drain(TunerSchedule &s) {
  std::vector<int> order;
  for (int c; (c = s.next()) >= 0;) {
    s.queued(c);
    order.push_back(c);
  }
  return order;
}

static void rounds_rotate() {
  TunerSchedule s(3, 3, 0.01f);
  const std::vector<int> want = {0, 1, 2, 1, 2, 0, 2, 0, 1};
  const std::vector<int> got = drain(s);
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) EXPECT_EQ(got[i], want[i]);
  EXPECT_EQ(s.next(), -1);  // all queued: waiting for samples
  EXPECT_EQ(s.measured(), false);
}

static void lowest_median_wins() {
  TunerSchedule s(3, 3, 0.01f);
  drain(s);
  const float t[3][3] = {{1.00f, 1.02f, 5.0f}, {0.90f, 0.91f, 0.10f}, {0.95f, 0.96f, 0.97f}};
  for (int c = 0; c < 3; ++c)
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(s.measured(), false);
      s.sample(c, t[c][r]);
    }
  EXPECT_EQ(s.measured(), true);
  EXPECT_EQ(s.median(0), 1.02f);  // an outlier does not move a median
  EXPECT_EQ(s.median(1), 0.90f);
  EXPECT_EQ(s.decide(), 1);
}

static void first_choice_kept_within_margin() {
  TunerSchedule s(2, 1, 0.01f);
  drain(s);
  s.sample(0, 1.000f);
  s.sample(1, 0.995f);  // 0.5% faster: noise
  EXPECT_EQ(s.decide(), 0);
  TunerSchedule t(2, 1, 0.01f);
  drain(t);
  t.sample(0, 1.000f);
  t.sample(1, 0.980f);  // 2% faster
  EXPECT_EQ(t.decide(), 1);
}

static void refused_candidates_are_skipped() {
  TunerSchedule s(3, 2, 0.01f);
  EXPECT_EQ(s.next(), 0);
  s.queued(0);
  EXPECT_EQ(s.next(), 1);
  s.refused(1);  // cuBLASLt refused it: the next call tries another
  EXPECT_EQ(s.next(), 2);
  const std::vector<int> rest = drain(s);
  for (int c : rest) EXPECT_EQ(c == 1, false);
  EXPECT_EQ(rest.size(), (size_t)3);  // 2 x candidate 2 and 1 more of candidate 0
  s.sample(0, 2.0f), s.sample(0, 2.0f), s.sample(2, 1.0f);
  EXPECT_EQ(s.measured(), false);
  s.sample(2, 1.0f);
  EXPECT_EQ(s.measured(), true);
  EXPECT_EQ(s.decide(), 2);
  EXPECT_EQ(s.median(1), -1.0f);
  EXPECT_EQ(s.summary().find("#1 refused") != std::string::npos, true);
}

static void single_candidate() {
  TunerSchedule s(1, 2, 0.01f);
  EXPECT_EQ(drain(s).size(), (size_t)2);
  s.sample(0, 1.0f), s.sample(0, 1.5f);
  EXPECT_EQ(s.decide(), 0);
}

int main() {
  rounds_rotate();
  lowest_median_wins();
  first_choice_kept_within_margin();
  refused_candidates_are_skipped();
  single_candidate();
  return check_report("test_gemm_tuner_schedule");
}
