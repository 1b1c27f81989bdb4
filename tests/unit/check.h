// check.h - the few checks tests/unit's C++ tests need: EXPECT / EXPECT_EQ count failures
// (printing file:line and the values) and check_report() turns the count into main's result.
#pragma once

#include <cstdio>

inline int &check_failures() {
  static int n = 0;
  return n;
}

#define EXPECT(cond)                                                              \
  do {                                                                            \
    if (!(cond)) {                                                                \
      std::fprintf(stderr, "%s:%d: %s failed\n", __FILE__, __LINE__, #cond);     \
      ++check_failures();                                                         \
    }                                                                             \
  } while (0)

// a and b: numbers (printed as doubles when they differ)
#define EXPECT_EQ(a, b)                                                                         \
  do {                                                                                          \
    const auto va_ = (a);                                                                       \
    const auto vb_ = (b);                                                                       \
    if (!(va_ == vb_)) {                                                                        \
      std::fprintf(stderr, "%s:%d: %s == %s failed (%g vs %g)\n", __FILE__, __LINE__, #a, #b,  \
                   (double)va_, (double)vb_);                                                   \
      ++check_failures();                                                                       \
    }                                                                                           \
  } while (0)

// main's return value: 0 when every check passed.
inline int check_report(const char *test) {
  if (check_failures()) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", test, check_failures());
    return 1;
  }
  std::printf("%s: all checks passed\n", test);
  return 0;
}
