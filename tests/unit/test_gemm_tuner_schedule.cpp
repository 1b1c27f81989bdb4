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
  TunerSchedule s(4, 3, 0.01f);  // candidates 1..3 are timed; 0 is the reference
  const std::vector<int> want = {1, 2, 3, 2, 3, 1, 3, 1, 2};
  const std::vector<int> got = drain(s);
  EXPECT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size() && i < got.size(); ++i) EXPECT_EQ(got[i], want[i]);
  EXPECT_EQ(s.next(), -1);  // all queued: waiting for samples
  EXPECT_EQ(s.measured(), false);
}

static void lowest_median_ratio_wins() {
  TunerSchedule s(3, 3, 0.01f);
  drain(s);
  // (candidate ms, first choice ms) per call: candidate 1 is 10% faster in every pair although
  // the clock drifts; candidate 2 is 3% faster with one outlier pair.
  const float t1[3][2] = {{0.90f, 1.00f}, {0.99f, 1.10f}, {0.81f, 0.90f}};
  const float t2[3][2] = {{0.97f, 1.00f}, {5.00f, 1.00f}, {0.97f, 1.00f}};
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(s.measured(), false);
    s.sample(1, t1[r][0], t1[r][1]);
    s.sample(2, t2[r][0], t2[r][1]);
  }
  EXPECT_EQ(s.measured(), true);
  EXPECT_EQ(s.ratio(0), 1.0f);
  EXPECT_EQ(s.ratio(1) > 0.899f && s.ratio(1) < 0.901f, true);
  EXPECT_EQ(s.ratio(2) > 0.969f && s.ratio(2) < 0.971f, true);  // an outlier does not move a median
  EXPECT_EQ(s.decide(), 1);
  EXPECT_EQ(s.summary().find("#0 1.0000 ms") != std::string::npos, true);  // median first-choice time
  EXPECT_EQ(s.summary().find("#1 x0.900") != std::string::npos, true);
}

static void first_choice_kept_within_margin() {
  TunerSchedule s(2, 1, 0.01f);
  drain(s);
  s.sample(1, 0.995f, 1.0f);  // 0.5% faster: noise
  EXPECT_EQ(s.decide(), 0);
  TunerSchedule t(2, 1, 0.01f);
  drain(t);
  t.sample(1, 0.980f, 1.0f);  // 2% faster
  EXPECT_EQ(t.decide(), 1);
  TunerSchedule u(2, 1, 0.01f);
  drain(u);
  u.sample(1, 1.2f, 1.0f);  // slower
  EXPECT_EQ(u.decide(), 0);
}

static void refused_candidates_are_skipped() {
  TunerSchedule s(4, 2, 0.01f);
  EXPECT_EQ(s.next(), 1);
  s.queued(1);
  EXPECT_EQ(s.next(), 2);
  s.refused(2);  // cuBLASLt refused it: the next call tries another
  EXPECT_EQ(s.next(), 3);
  const std::vector<int> rest = drain(s);
  for (int c : rest) EXPECT_EQ(c == 2, false);
  EXPECT_EQ(rest.size(), (size_t)3);  // 2 x candidate 3 and 1 more of candidate 1
  s.sample(1, 2.0f, 1.0f), s.sample(1, 2.0f, 1.0f), s.sample(3, 0.5f, 1.0f);
  EXPECT_EQ(s.measured(), false);
  s.sample(3, 0.5f, 1.0f);
  EXPECT_EQ(s.measured(), true);
  EXPECT_EQ(s.decide(), 3);
  EXPECT_EQ(s.ratio(2), -1.0f);
  EXPECT_EQ(s.summary().find("#2 refused") != std::string::npos, true);
}

static void single_candidate() {
  TunerSchedule s(1, 2, 0.01f);  // only the first choice: nothing to time
  EXPECT_EQ(s.next(), -1);
  EXPECT_EQ(s.measured(), true);
  EXPECT_EQ(s.decide(), 0);
}

// A candidate whose output differed from the first choice's on a checked call is dropped even
// when it is the fastest and all its samples are in (samples that arrive after are ignored).
static void differing_candidate_is_never_chosen() {
  TunerSchedule s(3, 2, 0.01f);
  drain(s);
  for (int r = 0; r < 2; ++r) s.sample(1, 0.5f, 1.0f), s.sample(2, 0.9f, 1.0f);
  EXPECT_EQ(s.measured(), true);
  EXPECT_EQ(s.decide(), 1);
  s.differs(1);
  EXPECT_EQ(s.live(1), false);
  EXPECT_EQ(s.ratio(1), -1.0f);
  EXPECT_EQ(s.decide(), 2);
  s.sample(1, 0.1f, 1.0f);
  EXPECT_EQ(s.decide(), 2);
  EXPECT_EQ(s.summary().find("#1 differs") != std::string::npos, true);
  TunerSchedule t(2, 2, 0.01f);  // dropped before its samples: measured without them
  drain(t);
  t.sample(1, 0.5f, 1.0f);
  EXPECT_EQ(t.measured(), false);
  t.differs(1);
  EXPECT_EQ(t.measured(), true);
  EXPECT_EQ(t.decide(), 0);
  EXPECT_EQ(t.next(), -1);
}

static void warmup_calls_come_first() {
  TunerSchedule s(3, 2, 0.01f, 3);  // three untimed calls, then the timed ones
  for (int i = 0; i < 3; ++i) EXPECT_EQ(s.warming_up(), true);
  for (int i = 0; i < 10; ++i) EXPECT_EQ(s.warming_up(), false);  // and never again
  EXPECT_EQ(drain(s).size(), (size_t)4);  // the timed calls themselves are unchanged
  TunerSchedule none(3, 2, 0.01f);  // default: no warm-up
  EXPECT_EQ(none.warming_up(), false);
}

int main() {
  warmup_calls_come_first();
  rounds_rotate();
  lowest_median_ratio_wins();
  first_choice_kept_within_margin();
  refused_candidates_are_skipped();
  single_candidate();
  differing_candidate_is_never_chosen();
  return check_report("test_gemm_tuner_schedule");
}
