// The NVTE_GEMM_AUTOTUNE_CACHE file format (core/cuda/gemm_tune_cache.h), without a GPU.
// Run by ctest.
#include "check.h"
#include "../../core/cuda/gemm_tune_cache.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

using namespace nvte::cuda;

static void round_trip() {
  TuneRecord r{"cublaslt=130100 sm=90 NVIDIA_H100 k=4096,8192,4096", 5, {23, 36, 1, 0, 0, 4, 0}};
  const std::string line = format_tune_record(r);
  EXPECT(line == "cublaslt=130100 sm=90 NVIDIA_H100 k=4096,8192,4096 -> 5 23 36 1 0 0 4 0");
  TuneRecord back;
  EXPECT(parse_tune_record(line, &back));
  EXPECT(back.key == r.key && back.index == 5 && back.config == r.config);
}

static void malformed_lines() {
  TuneRecord r;
  EXPECT(!parse_tune_record("", &r));
  EXPECT(!parse_tune_record("no arrow 5 1 2", &r));
  EXPECT(!parse_tune_record(" -> 1 2 3", &r));          // empty key
  EXPECT(!parse_tune_record("key -> -1 2 3", &r));      // negative index
  EXPECT(!parse_tune_record("key -> 3", &r));           // no config
  EXPECT(!parse_tune_record("key -> 3 4 x 5", &r));     // not a number
  EXPECT(!parse_tune_record("key -> three 4 5", &r));
}

static void file_append_and_read() {
  char path[] = "/tmp/nvte_tune_cache_testXXXXXX";
  const int fd = mkstemp(path);
  EXPECT(fd >= 0);
  close(fd);
  EXPECT(append_tune_record(path, {"a", 1, {10, 11}}));
  EXPECT(append_tune_record(path, {"b", 2, {20}}));
  {
    std::ofstream f(path, std::ios::app);
    f << "garbage line\n";
  }
  EXPECT(append_tune_record(path, {"a", 7, {70}}));  // a later record of a key: the first wins
  const auto m = read_tune_cache(path);
  EXPECT(m.size() == 2);
  EXPECT(m.count("a") && m.at("a").index == 1 && m.at("a").config.size() == 2);
  EXPECT(m.count("b") && m.at("b").index == 2);
  unlink(path);
  EXPECT(read_tune_cache(path).empty());                       // a missing file reads as empty
  EXPECT(!append_tune_record("/nonexistent_dir/x", {"a", 1, {1}}));  // unwritable: false
}

int main() {
  round_trip();
  malformed_lines();
  file_append_and_read();
  return check_report("test_gemm_tune_cache");
}
